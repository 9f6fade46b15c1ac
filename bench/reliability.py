"""Load with faults injected (`specserve bench --section reliability`): greedy requests over HTTP, mixed prompt and
output lengths, streamed and not, on both arms, while each fault of `bench.faults` strikes once.

Every request ends one of four ways:
- **completed**: a 200 with the whole completion (a stream with its finish chunk and `[DONE]`); **degraded**
  among them when `usage.speculative.degraded` says the drafter was down for part of it;
- **errored**: a clean error answer: a 4xx/5xx with OpenAI's error body, or an SSE error event then `[DONE]`;
- **lost**: an unclean end (connection dropped, a stream without `[DONE]`, a 5xx without an error body);
- **hung**: no end within `request_timeout_s` + `HANG_SLACK_S`.
Also checked: exact-arm outputs equal the target-only greedy ones, no ledger over budget, each fault's time to
recover (≤ `RECOVERY_GOAL_S`), and nothing left after the load. A worker node killed under the same load runs
on a multi-node cluster of its own (`node_section`, `bench.multinode`). The promises: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

from bench.faults import FAULTS, http_probe, inject, time_to_recover
from bench.harness import percentile
from bench.load import LoadRequest, Outcome, plan_load, run_load

RECOVERY_GOAL_S = 30.0
IDLE_TIMEOUT_S = 60.0


async def load_with_faults(app: str, url: str, model: str, requests: list[LoadRequest], *, concurrency: int,
                           timeout_s: float, faults: tuple[str, ...] = FAULTS, headers: dict[str, str] | None = None,
                           injectors: dict | None = None) -> tuple[list[Outcome], list[dict]]:
    """The load, with fault k injected once (k + 1) / (len(faults) + 1) of the requests have ended, each
    after the previous one recovered; returns the outcomes and, per fault, what was killed and the recovery time.
    `injectors` maps a fault outside `FAULTS` (a node: `bench.multinode.LocalCluster.kill_node`) to a blocking
    call that injects it and returns its record, with "at" (monotonic) the moment it struck."""
    import httpx

    ended = asyncio.Event()
    count = 0

    def on_done(_):
        nonlocal count
        count += 1
        ended.set()

    async def injector():
        injected = []
        async with httpx.AsyncClient() as client:
            probe = http_probe(client, url, model, headers)
            for k, fault in enumerate(faults):
                while count < (k + 1) * len(requests) / (len(faults) + 1):
                    ended.clear()
                    await ended.wait()
                in_flight = min(concurrency, len(requests) - count)
                kill = (injectors or {}).get(fault)
                record = await asyncio.to_thread(kill) if kill else inject(fault, app)
                record.update(fault=fault, in_flight_at_kill=in_flight)
                record["recovery_s"] = await time_to_recover(probe, record.pop("at"))
                injected.append(record)
        return injected

    task = asyncio.ensure_future(injector())
    outcomes = await run_load(url, model, requests, concurrency=concurrency, timeout_s=timeout_s, headers=headers,
                              on_done=on_done)
    return outcomes, await task


def references(url: str, model: str, prompts: list[tuple[int, ...]], lengths: tuple[int, ...], arm: str, *,
               concurrency: int, timeout_s: float, headers: dict[str, str] | None = None) -> dict:
    """Target-only greedy text per (prompt, max_tokens), before any fault."""
    combos = [(p, n) for p in prompts for n in lengths]
    requests = [LoadRequest(i, p, n, False, arm) for i, (p, n) in enumerate(combos)]
    outcomes = asyncio.run(run_load(url, model, requests, concurrency=concurrency, timeout_s=timeout_s,
                                    headers=headers, speculate=False))
    if any(o.end != "completed" for o in outcomes):
        raise RuntimeError(f"reference requests failed: {[asdict(o) for o in outcomes if o.end != 'completed']}")
    return {combo: o.text for combo, o in zip(combos, outcomes)}


def summarize(requests: list[LoadRequest], outcomes: list[Outcome], injected: list[dict], reference: dict,
              exact_arm: str, export_rows: list[dict], leaks: dict) -> dict:
    """The section's figures and goals (see the module docstring)."""
    ends = {e: sum(o.end == e for o in outcomes) for e in ("completed", "errored", "lost", "hung")}
    codes: dict[str, int] = {}
    for o in outcomes:
        if o.end == "errored":
            codes[o.code] = codes.get(o.code, 0) + 1
    checked = [(r, o) for r, o in zip(requests, outcomes) if o.end == "completed" and r.arm == exact_arm]
    mismatched = [r.index for r, o in checked if o.text != reference[(r.prompt, r.max_tokens)]]
    over = [row["request_id"] for row in export_rows
            if row.get("regret_budget") is not None and (row.get("regret_spent") or 0.0) > row["regret_budget"] + 1e-6]
    over += [o.index for o in outcomes if o.regret_budget is not None and o.regret_spent > o.regret_budget + 1e-6]
    latencies = sorted(o.latency_s for o in outcomes if o.end in ("completed", "errored"))
    recoveries = [f["recovery_s"] for f in injected]
    goals = {
        "none_lost_or_hung": ends["lost"] + ends["hung"] == 0,
        "greedy_identical": not mismatched,
        "ledgers_within_budget": not over,
        "nothing_leaked": not any(leaks.values()),
        "recovered_within_30s": all(r is not None and r <= RECOVERY_GOAL_S for r in recoveries),
    }
    return {
        "requests": len(outcomes), **ends, "degraded": sum(o.degraded for o in outcomes), "error_codes": codes,
        "latency_s": {f"p{q}": percentile(latencies, q) for q in (50, 95, 99)},
        "faults": injected, "max_recovery_s": max((r for r in recoveries if r is not None), default=None),
        "exact_checked": len(checked), "exact_mismatched": mismatched, "ledgers_checked": len(export_rows),
        "over_budget": over, "leaks": leaks, "goals": goals, "all_goals_met": all(goals.values()),
    }


def wait_idle(app: str, timeout_s: float = IDLE_TIMEOUT_S) -> dict:
    """What the app's decoder still holds once nothing runs (empty lists when nothing leaked)."""
    from ray import serve

    from cluster.serving.app import DECODER_DEPLOYMENT

    keys = ("active_requests", "target_sequences", "drafter_sequences", "open_ledgers")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = serve.get_deployment_handle(DECODER_DEPLOYMENT, app_name=app).stats.remote().result()
        except Exception as err:  # a replica still starting: ask again
            stats = {key: [f"unavailable: {type(err).__name__}"] for key in keys}
        leaks = {key: list(stats.get(key, [])) for key in keys}
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks
        time.sleep(0.5)


def run_faults(app: str, url: str, model: str, prompts: list[tuple[int, ...]], *, requests: int, concurrency: int,
               lengths: tuple[int, ...], arms: tuple[str, ...], exact_arm: str, timeout_s: float,
               faults: tuple[str, ...] = FAULTS, headers: dict[str, str] | None = None, seed: int = 0,
               injectors: dict | None = None) -> dict:
    """References first (no fault yet), then the load with every fault; the `summarize` figures."""
    import httpx

    reference = references(url, model, prompts, lengths, exact_arm, concurrency=concurrency, timeout_s=timeout_s,
                           headers=headers)
    plan = plan_load(prompts, requests, lengths, arms, seed)
    outcomes, injected = asyncio.run(load_with_faults(app, url, model, plan, concurrency=concurrency,
                                                      timeout_s=timeout_s, faults=faults, headers=headers,
                                                      injectors=injectors))
    leaks = wait_idle(app)
    export = httpx.get(f"{url}/v1/specserve/export", headers=headers, timeout=60).json()
    return summarize(plan, outcomes, injected, reference, exact_arm, export["requests"], leaks)


def fault_config(config, *, drafter_source: str, concurrency: int, timeout_s: float) -> dict:
    """The dumped config the fault load runs against: a model drafter in its own actor (one of the faults),
    drafting every round (γ fixed at 2), the target in its own actor (`target.process: actor`: with a TP = 1
    target in the replica, the default, a target fault is a replica fault, measured on its own), one unit,
    room for `concurrency` requests, no audit."""
    from cluster.config import SpecServeConfig, dump_config, parse_config

    out = dump_config(config if isinstance(config, SpecServeConfig) else parse_config(config))  # every field
    drafter = out["drafter"]
    if drafter["kind"] != "model":
        drafter.update(kind="model", source=drafter_source, device=out["target"]["device"],
                       resources={"num_cpus": 0.25, "num_gpus": drafter["resources"]["num_gpus"]})
    out["gamma"].update(mode="fixed", fixed=2, gamma_min=0, gamma_max=max(2, out["gamma"]["gamma_max"]))
    out["target"]["max_batch_size"] = max(out["target"]["max_batch_size"], concurrency)
    out["target"]["process"] = "actor"
    out["serving"].update(request_timeout_s=timeout_s,
                          max_ongoing_requests=max(out["serving"]["max_ongoing_requests"], concurrency),
                          max_queued_requests=max(out["serving"]["max_queued_requests"], 2 * concurrency))
    out["autoscaling"].update(enabled=False, min_replicas=1, max_replicas=1, initial_replicas=1)
    out["audit"]["fraction"] = 0.0
    return dump_config(parse_config(out))


# --------------------------------------------------------------------------------- specserve bench --section

PRESETS = {  # requests and concurrency of the fault load, fuzz cases per route and mode, stall repeats
    "full": {"requests": 200, "concurrency": 16, "lengths": (16, 48, 96), "fuzz_examples": 200, "stall_repeats": 2},
    "quick": {"requests": 40, "concurrency": 8, "lengths": (8, 24, 48), "fuzz_examples": 50, "stall_repeats": 1},
}
FAULT_TIMEOUT_S = 300.0  # request_timeout_s of the fault load (a shared 2-core machine is slow)
FUZZ_MAX_TOKENS = 16  # the fuzzed app's max_tokens limit: what is tested is the input, not long generations
LONG_PROMPT_TOKENS = 1500
STALL_CHUNKS = (None, 16, 32, 64, 128)  # prefill_chunk_tokens compared (plus the config's own)


def main_section(args, command: str) -> int:
    """`specserve bench --section reliability [--quick] [--out DIR] [CONFIG]`: fuzzing, faults under load and
    the long-prefill stall, written to DIR/results.json and DIR/report.md."""
    import logging
    from datetime import datetime, timezone
    from pathlib import Path

    log = logging.getLogger("specserve.bench")
    preset_name = "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    out = Path(args.out or f"bench-out/reliability-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    results = {"meta": {"command": command, "started": started,
                        "config": args.config, "preset": {k: list(v) if isinstance(v, tuple) else v
                                                           for k, v in preset.items()}}}
    parts = out / "parts"  # each part is kept as soon as it is measured; --resume reuses them
    parts.mkdir(exist_ok=True)
    results.update(_served_sections(args, preset, log, parts))
    results["prefill_stall"] = _part(parts / "prefill_stall.json", args.resume,
                                     lambda: _stall_section(args, preset, log))
    results["node_fault"] = _part(parts / "node_fault.json", args.resume, lambda: node_section(args, preset, log))
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "report.md").write_text(report_markdown(results))
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0


def _part(path, resume: bool, measure):
    """A part of the section: read back from `path` when resuming, else measured and written there."""
    if resume and path.is_file():
        return json.loads(path.read_text())
    data = measure()
    path.write_text(json.dumps(data, indent=1, default=str))
    return data


def _served_sections(args, preset: dict, log, parts) -> dict:
    from bench.fuzz import fuzz
    from bench.http_bench import ServedApp, bench_config, exact_arm
    from cluster.config import load_config, parse_config

    config = load_config(args.config)
    prompts = _prompts(config)
    exact = exact_arm(config)
    with ServedApp(port=args.port) as served:

        def fuzzed():
            fuzz_config = bench_config(config, name="specserve-rel-fuzz", fixed_gamma=None, port=args.port)
            fuzz_config = fuzz_config.model_copy(update={"serving": fuzz_config.serving.model_copy(  # the input is
                update={"max_tokens_limit": FUZZ_MAX_TOKENS, "default_max_tokens": FUZZ_MAX_TOKENS})})  # tested
            served.deploy(fuzz_config)
            log.info("fuzzing every route (%d cases per route and mode)", preset["fuzz_examples"])
            report = fuzz(served.url, examples=preset["fuzz_examples"])
            return {**report.summary(), "leaks": wait_idle(fuzz_config.name)}

        def faulted():
            faulty = parse_config(fault_config(config.model_copy(update={"name": "specserve-rel-faults"}),
                                               drafter_source=config.target.source,
                                               concurrency=preset["concurrency"], timeout_s=FAULT_TIMEOUT_S))
            served.deploy(faulty)
            log.info("%d requests at concurrency %d, faults %s", preset["requests"], preset["concurrency"], FAULTS)
            return run_faults(faulty.name, served.url, faulty.target.served_name, prompts,
                              requests=preset["requests"], concurrency=preset["concurrency"],
                              lengths=preset["lengths"], arms=tuple(a.name for a in config.arms), exact_arm=exact,
                              timeout_s=FAULT_TIMEOUT_S)

        return {"fuzz": _part(parts / "fuzz.json", args.resume, fuzzed),
                "faults": _part(parts / "faults.json", args.resume, faulted)}


def _prompts(config) -> list[tuple[int, ...]]:
    from actors.sources import load_tokenizer
    from bench.workloads import load_workload

    tokenizer = load_tokenizer(config.target.source)
    return [p.ids for w in ("chat", "code", "summarization") for p in load_workload(w, tokenizer, 2, seed=0)]


def node_section(args, preset: dict, log) -> dict:
    """A worker node killed under the fault load (`bench.multinode.node_fault`): two units of the config on a
    head and two worker nodes, the target's own model as the drafter, as in the faults part."""
    from bench.http_bench import exact_arm
    from bench.multinode import KILLED, NODES, multinode_config, node_fault
    from cluster.config import load_config

    config = load_config(args.config)
    exact, prompts = exact_arm(config), _prompts(config)
    faulty = multinode_config(fault_config(config.model_copy(update={"name": "specserve-rel-node"}),
                                           drafter_source=config.target.source, concurrency=preset["concurrency"],
                                           timeout_s=FAULT_TIMEOUT_S))
    log.info("%d requests at concurrency %d on nodes %s, node %s killed", preset["requests"], preset["concurrency"],
             list(NODES), KILLED)

    def load(app: str, url: str, injectors: dict) -> dict:
        return run_faults(app, url, faulty["target"]["served_name"], prompts, requests=preset["requests"],
                          concurrency=preset["concurrency"], lengths=preset["lengths"],
                          arms=tuple(a.name for a in config.arms), exact_arm=exact, timeout_s=FAULT_TIMEOUT_S,
                          faults=("node",), injectors=injectors)

    return node_fault(faulty, args.port, load)


def _stall_section(args, preset: dict, log) -> list[dict]:
    from actors.policy import LocalPolicy, PolicyCore
    from actors.sources import model_info
    from actors.unit import TargetSetup, build_unit
    from bench.prefill_stall import compare
    from cluster.config import load_config

    config = load_config(args.config)
    target = config.target
    chunks = sorted({*STALL_CHUNKS, target.prefill_chunk_tokens}, key=lambda c: -1 if c is None else c)
    log.info("long prefill beside 8 streams, prefill_chunk_tokens in %s", chunks)
    unit = build_unit(unit="stall", target=TargetSetup(target.source, target.dtype, target.device,
                                                       max_slots=max(16, target.max_batch_size),
                                                       max_seq_len=target.max_seq_len),
                      on_ray=False, policy=LocalPolicy(PolicyCore()), torch_threads=config.unit.torch_threads)
    info = model_info(target.source)
    room = min(target.max_seq_len or info["max_position_embeddings"], info["max_position_embeddings"])
    return compare(unit, chunks, vocab_size=info["vocab_size"], repeats=preset["stall_repeats"],
                   long_tokens=min(LONG_PROMPT_TOKENS, room - 8), stream_tokens=min(400, room - 32))


def report_markdown(results: dict) -> str:
    """The section's figures as markdown (docs/reliability.md quotes them)."""
    fz, ft = results["fuzz"], results["faults"]
    lines = [f"# Reliability ({results['meta']['started']})", "", f"`{results['meta']['command']}`", "",
             "## Fuzzing", "", f"{fz['cases']} cases in {fz['seconds']:.0f} s: {fz['server_errors']} responses "
             f"≥ 500, {fz['failures']} failed checks; leaks after: {fz['leaks']}", "",
             "## Faults under load", "",
             f"{ft['requests']} requests: {ft['completed']} completed ({ft['degraded']} degraded), {ft['errored']} "
             f"errored {ft['error_codes']}, {ft['lost']} lost, {ft['hung']} hung; latency p50/p95/p99 "
             + "/".join(f"{ft['latency_s'][f'p{q}'] or 0:.2f}" for q in (50, 95, 99)) + " s", "",
             "| fault | pid | service answers again after |", "|---|---|---|"]
    lines += [f"| {f['fault']} | {f['pid']} | "
              + ("never (past the limit)" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s") + " |"
              for f in ft["faults"]]
    lines += ["", f"exact-arm outputs checked {ft['exact_checked']}, mismatched {len(ft['exact_mismatched'])}; "
              f"ledgers checked {ft['ledgers_checked']}, over budget {len(ft['over_budget'])}; leaks {ft['leaks']}",
              f"goals: {ft['goals']}", "", "## Long prefill beside 8 decoding streams", "",
              "| prefill_chunk_tokens | steady p95 ITL | p95 ITL during the prefill | ratio (runs) | long TTFT |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['chunk']} | {s['steady_p95_itl_s']:.3f} s | {s['during_p95_itl_s']:.3f} s | "
              f"{s['ratio']:.2f} ({', '.join(f'{r:.2f}' for r in s['ratios'])}) | {s['long_ttft_s']:.2f} s |"
              for s in results["prefill_stall"]]
    if results.get("node_fault"):
        lines += [""] + node_markdown(results["node_fault"])
    return "\n".join(lines) + "\n"


def node_markdown(nf: dict) -> list[str]:
    """The node fault's lines of the report."""
    (fault,) = nf["faults"]
    recovered = "never (past the limit)" if fault["recovery_s"] is None else f"{fault['recovery_s']:.1f} s"
    replaced = "never (past the limit)" if nf["replaced_after_s"] is None else f"{nf['replaced_after_s']:.1f} s"
    return ["## A worker node killed under load", "",
            f"{nf['requests']} requests: {nf['completed']} completed ({nf['degraded']} degraded), {nf['errored']} "
            f"errored {nf['error_codes']}, {nf['lost']} lost, {nf['hung']} hung; {fault['in_flight_at_kill']} in "
            f"flight at the kill of node {fault['node']} ({fault['actors']} actors, reported dead after "
            f"{fault['dead_after_s']:.1f} s)", "",
            f"service answers again after {recovered} (goal ≤ {RECOVERY_GOAL_S:.0f} s); every unit placed again "
            f"after {replaced}", "",
            f"units before: {nf['units_before']}", f"units after: {nf['units_after']}", "",
            f"exact-arm outputs checked {nf['exact_checked']}, mismatched {len(nf['exact_mismatched'])}; ledgers "
            f"checked {nf['ledgers_checked']}, over budget {len(nf['over_budget'])}; leaks {nf['leaks']}",
            f"goals: {nf['goals']}"]
