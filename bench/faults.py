"""Faults injected into a served app: the process of one of its actors is killed with SIGKILL (`FAULTS`: the
drafter, a target shard, the policy actor, a decoder replica), and `time_to_recover` measures how long until
the service answers again. What each fault must and must not do: docs/reliability.md.

Actors are found in the GCS actor table (`ray._private.state.actors()`), which works without Ray's dashboard; a
unit's drafter and shards are the actors its replica owns.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

FAULTS = ("drafter", "target_shard", "policy", "replica")
RECOVERY_LIMIT_S = 120.0  # give up measuring recovery after this long
PROBE_TIMEOUT_S = 30.0


def _alive() -> list[dict]:
    import ray._private.state

    return [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE" and a.get("Pid")]


def _address(actor: dict, key: str) -> tuple:
    address = actor.get(key) or {}
    return address.get("IPAddress"), address.get("Port")


def fault_pid(fault: str, app: str) -> int:
    """The pid to kill for `fault` in Serve app `app` (for a drafter or shard: one its decoder replicas own)."""
    from cluster.serving.app import DECODER_DEPLOYMENT
    from cluster.serving.decoder import policy_actor_name

    if fault not in FAULTS:
        raise ValueError(f"fault: expected one of {FAULTS}, got {fault!r}")
    actors = _alive()
    if fault == "policy":
        found = [a for a in actors if a.get("Name") == policy_actor_name(app)]
    else:
        replicas = [a for a in actors if a["ActorClassName"] == f"ServeReplica:{app}:{DECODER_DEPLOYMENT}"]
        if fault == "replica" or not replicas:
            found = replicas
        else:
            owners = {_address(r, "Address") for r in replicas}
            kind = {"drafter": "DrafterHost", "target_shard": "TargetShard"}[fault]
            found = [a for a in actors if a["ActorClassName"] == kind and _address(a, "OwnerAddress") in owners]
    if not found:
        raise LookupError(f"no live actor for fault {fault!r} in app {app!r}")
    return int(found[-1]["Pid"])  # the last shard (a non-lead rank when TP > 1)


def inject(fault: str, app: str) -> dict:
    """Kill the process behind `fault`; {"fault", "pid", "at"} (at: time.monotonic())."""
    pid = fault_pid(fault, app)
    os.kill(pid, signal.SIGKILL)
    return {"fault": fault, "pid": pid, "at": time.monotonic()}


async def time_to_recover(probe, since: float, limit_s: float = RECOVERY_LIMIT_S) -> float | None:
    """Seconds from `since` (monotonic) until `await probe()` first returns True; None past `limit_s`."""
    while time.monotonic() - since < limit_s:
        try:
            if await probe():
                return time.monotonic() - since
        except Exception:
            pass
        await asyncio.sleep(0.5)
    return None


def http_probe(client, url: str, model: str, headers: dict[str, str] | None = None):
    """A probe: one short greedy completion on the exact path answers 200."""

    async def probe() -> bool:
        response = await client.post(f"{url}/v1/completions", headers=headers, timeout=PROBE_TIMEOUT_S,
                                     json={"model": model, "prompt": "ping", "max_tokens": 2, "temperature": 0})
        return response.status_code == 200

    return probe
