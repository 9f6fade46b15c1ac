"""A/B assignment: which **arm** (verification setting) serves a request.

`ArmRouter.assign(user, forced)` chooses, in this order:
1. **forced**: the request header `ARM_HEADER` (`x-specserve-arm: NAME`); an unknown name raises
   `UnknownArmError` (a ValueError the ingress turns into a 400);
2. **sticky**: with a `user`, a stable SHA-256 hash of (salt, user) (`stable_unit_interval`), so one user
   always sees one arm for a given salt and arm list;
3. **random** by weight otherwise.
Both 2 and 3 map a uniform u in [0, 1) onto the cumulative normalised weights: an arm with weight w gets a share
w / Σw. The ingress echoes the chosen arm in `ARM_RESPONSE_HEADER` and in `usage.speculative.arm`.

The arms and the audit are the ingress deployment's Serve `user_config` (`ingress_user_config`), so a change of
them alone reaches the running ingress replicas (`with_ingress_settings`) without restarting a unit
(docs/reliability.md, "Upgrades under load").
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from cluster.config import ArmConfig, SpecServeConfig, dump_config, parse_config

ARM_HEADER = "x-specserve-arm"  # request header forcing an arm
ARM_RESPONSE_HEADER = "x-specserve-arm"  # response header naming the arm that served the request
DEFAULT_SALT = "specserve"
INGRESS_SETTINGS = ("arms", "audit")  # the config's parts that the ingress's user_config carries


class UnknownArmError(ValueError):
    """A forced arm name that is not one of the configured arms."""

    def __init__(self, name: str, known: Sequence[str]):
        super().__init__(f"unknown arm {name!r} in header {ARM_HEADER}; known arms: {list(known)}")
        self.name = name
        self.known = tuple(known)


def stable_unit_interval(salt: str, key: str) -> float:
    """A uniform number in [0, 1) from SHA-256 of (salt, key): the same on every process, host and run."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class ArmRouter:
    """Assigns requests to arms: forced by header, sticky by user, random by weight otherwise.

    `arms` is the config's arm list (non-empty, unique names, weights > 0 as validated by `ArmConfig`).
    `rng` is the generator of random assignments; inject a seeded one for reproducible runs.
    """

    def __init__(self, arms: Sequence[ArmConfig], salt: str = DEFAULT_SALT, rng: random.Random | None = None):
        if not arms:
            raise ValueError("arms: at least one arm is required")
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arms: names must be unique, got {names}")
        if any(arm.weight <= 0 for arm in arms):
            raise ValueError(f"arms: weights must be > 0, got {[arm.weight for arm in arms]}")
        self.arms: tuple[ArmConfig, ...] = tuple(arms)
        self.salt = salt
        self._by_name = {arm.name: arm for arm in arms}
        total = sum(arm.weight for arm in arms)
        self._cumulative = [c / total for c in accumulate(arm.weight for arm in arms)]  # ends at 1.0
        self._rng = rng if rng is not None else random.Random()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(arm.name for arm in self.arms)

    def get(self, name: str) -> ArmConfig:
        """The arm called `name`; `UnknownArmError` otherwise."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownArmError(name, self.names) from None

    def assign(self, user: str | None, forced: str | None = None, rng: random.Random | None = None) -> ArmConfig:
        """The arm serving one request.

        `forced` is the `x-specserve-arm` header value (stripped; empty means absent); `user` is the OpenAI
        `user` field (empty means absent); `rng` overrides the router's generator for this call.
        """
        if forced is not None and forced.strip():
            return self.get(forced.strip())
        if user:
            return self._pick(stable_unit_interval(self.salt, user))
        return self._pick((rng or self._rng).random())

    def _pick(self, u: float) -> ArmConfig:
        """The arm whose cumulative-weight interval holds u in [0, 1)."""
        index = bisect.bisect_right(self._cumulative, u)
        return self.arms[min(index, len(self.arms) - 1)]  # min() guards float rounding of the last edge


def ingress_user_config(config: SpecServeConfig) -> dict[str, Any]:
    """The ingress deployment's Serve `user_config`: the config's arms and audit settings, as JSON."""
    data = dump_config(config)
    return {key: data[key] for key in INGRESS_SETTINGS}


def with_ingress_settings(config: SpecServeConfig, user_config: Any) -> SpecServeConfig:
    """`config` with the arms and audit of a `user_config` (either may be left out), validated as a whole
    config; a ValueError naming the field (`user_config: arms[1].weight ...`) otherwise."""
    if not isinstance(user_config, dict):
        raise ValueError(f"user_config: expected a mapping with {list(INGRESS_SETTINGS)}, "
                         f"got {type(user_config).__name__}")
    unknown = sorted(set(user_config) - set(INGRESS_SETTINGS))
    if unknown:
        raise ValueError(f"user_config: unknown keys {unknown}; the ingress takes {list(INGRESS_SETTINGS)}")
    return parse_config({**dump_config(config), **user_config}, source="user_config")
