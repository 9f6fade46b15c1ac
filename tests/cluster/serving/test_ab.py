"""A/B assignment: forcing, stickiness, weight proportions."""

import hashlib
import math
import random
from collections import Counter

import pytest

from cluster.config import ArmConfig, ASDSettings
from cluster.serving.ab import ARM_HEADER, ARM_RESPONSE_HEADER, ArmRouter, UnknownArmError, stable_unit_interval

EXACT = ArmConfig(name="exact", verification="exact", weight=1.0)
ASD = ArmConfig(name="asd", verification="asd", asd=ASDSettings(g=2.0, max_relaxed_per_block=2, budget=8.0),
                weight=3.0)


def test_header_names():
    assert ARM_HEADER == "x-specserve-arm" == ARM_RESPONSE_HEADER


def test_forced_arm_wins_over_user():
    router = ArmRouter([EXACT, ASD])
    for user in ("alice", "bob", None):
        assert router.assign(user, forced="exact").name == "exact"
        assert router.assign(user, forced=" asd ").name == "asd"


def test_unknown_forced_arm_names_it():
    router = ArmRouter([EXACT, ASD])
    with pytest.raises(UnknownArmError, match="'nope'") as err:
        router.assign("alice", forced="nope")
    assert isinstance(err.value, ValueError)
    assert err.value.known == ("exact", "asd")


def test_empty_forced_and_user_fall_back_to_random():
    router = ArmRouter([EXACT, ASD], rng=random.Random(0))
    assert {router.assign("", forced="").name for _ in range(200)} == {"exact", "asd"}


def test_sticky_by_user_across_routers_and_rngs():
    a = ArmRouter([EXACT, ASD], rng=random.Random(1))
    b = ArmRouter([EXACT, ASD], rng=random.Random(2))
    users = [f"user-{i}" for i in range(500)]
    first = [a.assign(u).name for u in users]
    assert first == [a.assign(u).name for u in users]  # same router, repeated
    assert first == [b.assign(u, rng=random.Random(99)).name for u in users]  # another router/process
    assert set(first) == {"exact", "asd"}


def test_salt_reshuffles_users():
    users = [f"user-{i}" for i in range(500)]
    a = [ArmRouter([EXACT, ASD], salt="one").assign(u).name for u in users]
    b = [ArmRouter([EXACT, ASD], salt="two").assign(u).name for u in users]
    assert a != b


def test_stable_hash_is_sha256_not_python_hash():
    # Python's hash() of a str is salted per process, so stickiness across replicas needs a fixed digest.
    assert stable_unit_interval("specserve", "alice") == pytest.approx(
        int.from_bytes(hashlib.sha256(b"specserve\x00alice").digest()[:8], "big") / 2**64
    )


@pytest.mark.parametrize("mode", ["sticky", "random"])
def test_weight_proportions(mode):
    # Weights 1:3 give p(exact) = 0.25. With n = 20000 independent draws the share has standard deviation
    # sqrt(p(1-p)/n) = 0.0031; a 5-sigma bound (0.0153) fails a correct router with probability < 1e-6.
    # (Both modes are deterministic here: SHA-256 of fixed ids, a seeded generator.)
    n = 20_000
    router = ArmRouter([EXACT, ASD], rng=random.Random(1234))
    users = [f"user-{i}" for i in range(n)] if mode == "sticky" else [None] * n
    counts = Counter(router.assign(u).name for u in users)
    p = 0.25
    bound = 5 * math.sqrt(p * (1 - p) / n)
    assert abs(counts["exact"] / n - p) < bound


def test_single_arm_takes_everything():
    router = ArmRouter([EXACT])
    assert {router.assign(f"u{i}").name for i in range(50)} == {"exact"}
    assert router.assign(None).name == "exact"


def test_bad_arm_lists():
    with pytest.raises(ValueError, match="arms"):
        ArmRouter([])
    with pytest.raises(ValueError, match="unique"):
        ArmRouter([EXACT, EXACT])


def test_ingress_user_config_round_trips_the_arms_and_audit():
    from cluster.config import parse_config
    from cluster.serving.ab import ingress_user_config, with_ingress_settings

    base = parse_config({"name": "app", "target": {"source": "embedded:smollm2", "served_name": "m"}})
    full = base.model_copy(update={"arms": [EXACT, ASD]})
    user_config = ingress_user_config(full)
    assert set(user_config) == {"arms", "audit"}
    assert with_ingress_settings(base, user_config) == full
    assert with_ingress_settings(full, {}) == full  # either part may be left out


@pytest.mark.parametrize("user_config, message", [
    ({"arms": [{"name": "exact", "weight": 0}]}, "user_config: invalid config\n  arms[0].weight"),
    ({"arms": [{"name": "asd", "verification": "asd"}]}, "arms[0]"),
    ({"audit": {"fraction": 0.5, "reference_arm": "nope"}}, "audit.reference_arm 'nope'"),
    ({"gamma": {"gamma_max": 4}}, "user_config: unknown keys ['gamma']"),
    (["exact"], "user_config: expected a mapping"),
])
def test_a_bad_ingress_user_config_names_its_field(user_config, message):
    from cluster.config import parse_config
    from cluster.serving.ab import with_ingress_settings

    base = parse_config({"name": "app", "target": {"source": "embedded:smollm2", "served_name": "m"}})
    with pytest.raises(ValueError) as err:
        with_ingress_settings(base, user_config)
    assert message in str(err.value), str(err.value)
