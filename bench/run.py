"""`specserve bench [--quick] [--out DIR] [--resume] [--sections S,...] [--skip S,...] [CONFIG]`: the benchmark suite.

Writes `DIR/results.json` (top-level `summary`, `goals`, `sections`, `meta`), `DIR/report.md` and PNG plots;
progress goes to stderr. Each section is stored under `DIR/sections/` as soon as it finishes; `--resume`
reuses stored sections of the same plan and config. A single-stream section with more than `STALL_TOLERANCE`
of its rounds stalled is measured again, `STALL_RETRIES` times at most. Every figure is a ratio of modes
measured side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.plan import PRESETS, SECTIONS, ASDSetting, BenchPlan

log = logging.getLogger("specserve.bench")

DEFAULT_CONFIG = "configs/local.yaml"
TORCH_THREADS = 2
STALL_TOLERANCE = 0.02  # a single-stream section with more stalled rounds than this is measured again,
STALL_RETRIES = 2  # at most this many times


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench's arguments to `parser`."""
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"deployment config (default {DEFAULT_CONFIG})")
    parser.add_argument("--quick", action="store_true", help="the quick preset (< 6 min on 2 quiet cores)")
    parser.add_argument("--out", default=None, help="output folder (default bench-out/<preset>)")
    parser.add_argument("--resume", action="store_true", help="reuse sections stored by an earlier run of this plan")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated sections to run (default: the preset's; quick leaves out sampled and "
                        f"quality): {', '.join(SECTIONS)}")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out of those")
    parser.add_argument("--workloads", default=None, help="comma-separated workloads (default: all)")
    parser.add_argument("--prompts", type=int, default=None, help="override: prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=None, help="override: max_tokens per request")
    parser.add_argument("--repeats", type=int, default=None, help="override: repeats per measurement")
    parser.add_argument("--groups", default=None,
                        help="section vllm: comma-separated server groups (default: all; bench.vllm_peer.GROUPS)")
    parser.add_argument("--loads", default=None, help="section vllm: comma-separated concurrencies (default 1,8,32)")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port of the benchmark app (127.0.0.1)")
    parser.add_argument("--quality-suite", default=None, help="override: the quality section's eval suite")
    parser.add_argument("--quality-problems", type=int, default=None, help="override: its first N problems")
    parser.add_argument("--section", default="all",
                        choices=("all", "reliability", "vllm", "policy", "hub", "ramp", "breakdown", "features"),
                        help="reliability: fuzzing, faults under load, long-prefill stall (bench.reliability); "
                        "breakdown: one request's time per hop on both engines at 1, 8 and 32 streams "
                        "(bench.breakdown); features: what logprobs, penalties and a JSON schema cost on both "
                        "engines, speculative and target-only, at 1 and 8 streams (bench.features); "
                        "policy: the policy actor's capacity with 1 to 256 simulated units (bench.policy_capacity); "
                        "hub: the telemetry hub's, the same way (bench.hub_capacity); "
                        "ramp: autoscaling under a traffic ramp of 1 to 16 streams and back, on both engines "
                        "(bench.ramp); "
                        "vllm: specserve (both engines) vs vLLM's own server (bench.vllm_peer; "
                        "CONFIG defaults to configs/local-vllm.yaml)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments after `bench`, parsed; `argv` (the command line after `specserve`) is kept for the meta."""
    parser = configure_parser(argparse.ArgumentParser(prog="specserve bench", description=__doc__.split("\n\n")[0]))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["bench", *argv]
    return args


def command_line(args: argparse.Namespace) -> str:
    """The command as given (results.json's `meta.command`)."""
    return "specserve " + " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or ["bench"])


def make_plan(args: argparse.Namespace) -> BenchPlan:
    plan = PRESETS["quick" if args.quick else "full"]
    update = {}
    if args.sections:
        update["sections"] = _section_list("--sections", args.sections)
    if args.workloads:
        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        update.update(workloads=workloads,
                      batched_workloads=tuple(w for w in plan.batched_workloads if w in workloads) or workloads[:1],
                      asd_workloads=tuple(w for w in plan.asd_workloads if w in workloads),
                      hf_assistant_workloads=tuple(w for w in plan.hf_assistant_workloads if w in workloads),
                      http_workload=plan.http_workload if plan.http_workload in workloads else workloads[0])
    for field, value in (("prompts", args.prompts), ("max_tokens", args.max_tokens), ("repeats", args.repeats),
                         ("quality_suite", args.quality_suite), ("quality_problems", args.quality_problems)):
        if value is not None:
            update[field] = value
    return BenchPlan.model_validate({**plan.model_dump(), **update}) if update else plan


def _section_list(flag: str, text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = set(names) - set(SECTIONS)
    if unknown:
        raise ValueError(f"{flag}: unknown sections {sorted(unknown)} (known: {', '.join(SECTIONS)})")
    return names


class SectionStore:
    """Finished sections as JSON files; a stored section is reused only for the same plan and config."""

    def __init__(self, directory: Path, fingerprint: dict, resume: bool):
        self.directory = directory
        self.fingerprint = fingerprint
        self.resume = resume
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / (key.replace("/", "__") + ".json")

    def get(self, key: str):
        path = self._path(key)
        if not (self.resume and path.is_file()):
            return None
        stored = json.loads(path.read_text())
        return stored["data"] if stored.get("fingerprint") == self.fingerprint else None

    def put(self, key: str, data) -> None:
        tmp = self._path(key).with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "data": data}))
        tmp.replace(self._path(key))


def stalled_share(data: dict) -> float:
    """Share of a single-stream section's rounds that stalled (bench.speedup); 0 for other sections."""
    fits = data.get("fit", {}).values() if isinstance(data, dict) else ()
    rounds = sum(f.get("rounds") or 0 for f in fits)
    return sum(f.get("stalled_rounds") or 0 for f in fits) / rounds if rounds else 0.0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}; load average {load:.1f} at start")


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        log.info("[%d/%d +%.0fs] %s", self.done, self.total, time.monotonic() - self.start, what)


def _asd_settings(config, plan: BenchPlan, workload: str) -> list[tuple[str, ASDSetting]]:
    """The config's first ASD arm (the default, reported in the summary) then the plan's extra settings."""
    settings = []
    for arm in config.arms:
        if arm.verification == "asd":
            s = ASDSetting(g=arm.asd.g, max_relaxed_per_block=arm.asd.max_relaxed_per_block, budget=arm.asd.budget,
                           gate=arm.asd.gate)
            settings.append((f"{arm.name}:{s.label}", s))
            break
    if workload in plan.asd_workloads:
        settings += [(s.label, s) for s in plan.asd_settings if s.label not in {l.split(":")[-1] for l, _ in settings}]
    return settings


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(TORCH_THREADS)
    import transformers

    from actors.drafting import make_drafter
    from actors.engines.native import Engine, load_model
    from actors.sources import model_info
    from bench import sections
    from bench.drafter import bench_drafter_setup, drafter_label
    from bench.harness import InProcessBench
    from bench.workloads import load_workload
    from cluster.config import dump_config, load_config

    config = load_config(args.config)
    plan = make_plan(args)
    skip = set(_section_list("--skip", args.skip)) | (set(SECTIONS) - set(plan.sections))
    out = Path(args.out or f"bench-out/{plan.name}")
    store = SectionStore(out / "sections", {"plan": plan.model_dump(mode="json"), "config": dump_config(config)},
                         args.resume)
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    steps = len(plan.workloads) * (1 + ("asd" not in skip) + ("sampled" not in skip) + ("hf" not in skip)) + 2 + (
        0 if "batched" in skip else len(plan.batched_workloads)) + ("http" not in skip) + ("quality" not in skip)
    progress = Progress(steps)

    target = config.target
    info = model_info(target.source)
    model, tokenizer = load_model(target.source, target.dtype, target.device)
    max_slots = max(plan.batched_concurrency, target.max_batch_size, max(plan.http_concurrency))
    engine = Engine(model, max_slots=max_slots, max_seq_len=target.max_seq_len or info["max_position_embeddings"])
    drafter_cfg = config.drafter
    drafter = make_drafter(bench_drafter_setup(config), max_slots=max_slots, max_seq_len=engine.max_seq_len)
    gamma = config.gamma
    policy = dict(gamma_max=max(gamma.gamma_max, *plan.gammas, *plan.batched_gammas), gamma_min=gamma.gamma_min,
                  prior_alpha=gamma.prior_alpha, draft_cost=gamma.draft_cost)
    bench = InProcessBench(engine, drafter, eos_token_ids=info["eos_token_ids"], policy=policy,
                           max_tokens=plan.max_tokens, repeats=plan.repeats)
    prompts = {w: load_workload(w, tokenizer, plan.prompts, plan.seed) for w in plan.workloads}
    bench.warm_up(prompts[plan.workloads[0]][0])
    progress.step(f"loaded {target.source} and warmed up")

    reused = []

    def section(key: str, make):
        data = store.get(key)
        if data is not None:
            reused.append(key)
            progress.step(f"{key} (stored)")
            return data
        data = make()
        for _ in range(STALL_RETRIES):
            share = stalled_share(data)
            if share <= STALL_TOLERANCE:
                break
            log.info("  %s: %.0f%% of rounds stalled (the CPU was taken): measuring it again", key, 100 * share)
            data = make()
        store.put(key, data)
        progress.step(key)
        return data

    results: dict = {"single": {}, "batched": {}, "asd": {}, "sampled": {}, "hf": {}}
    for w in plan.workloads:
        results["single"][w] = section(f"single/{w}", lambda: sections.single_stream(bench, prompts[w], plan))
    if "batched" not in skip:
        for w in plan.batched_workloads:
            results["batched"][w] = section(f"batched/{w}", lambda: sections.batched(bench, prompts[w], plan))
    if "asd" not in skip:
        for w in plan.workloads:
            settings = _asd_settings(config, plan, w)
            if settings:
                results["asd"][w] = section(f"asd/{w}", lambda: sections.asd(
                    bench, prompts[w], settings, results["single"][w]["target_only_token_ids"]))
    if "sampled" not in skip:
        from bench.sampled import sampled_section

        for w in plan.workloads:
            arm = next(iter(_asd_settings(config, plan, w)[:1]), None)
            results["sampled"][w] = section(f"sampled/{w}", lambda: sampled_section(bench, prompts[w], arm))
    if "hf" not in skip:
        from actors.sources import resolve
        from bench.hf_peer import HFPeer

        peer = None
        for w in plan.workloads:
            def make():
                nonlocal peer
                if peer is None:
                    peer = HFPeer(resolve(target.source), max_tokens=plan.max_tokens,
                                  eos_token_ids=info["eos_token_ids"])
                modes = plan.hf_modes + (("assistant",) if w in plan.hf_assistant_workloads else ())
                return sections.hf_peer(bench, peer, prompts[w], modes, results["single"][w]["target_only_token_ids"])
            results["hf"][w] = section(f"hf/{w}", make)
    if "http" not in skip:
        w = plan.http_workload
        best = results["single"][w]["gamma_sweep"]["best_fixed_gamma"]
        results["http"] = section("http", lambda: sections.http(bench, config, prompts[w], plan, best,
                                                                  args.port))
    if "quality" not in skip:
        from bench.quality import quality_section

        results["quality"] = section("quality", lambda: quality_section(
            config, suite=plan.quality_suite, problems=plan.quality_problems, max_tokens=plan.quality_max_tokens,
            settings=plan.quality_asd_settings, out_dir=out / "quality", resume=args.resume, progress=log.info))
    progress.step("done")

    from bench.summary import build_summary, judge

    summary = build_summary(results)
    return {
        "summary": summary,
        "goals": judge(summary, results),
        "meta": {
            "command": command_line(args),
            "machine": machine(), "started": started, "elapsed_s": time.monotonic() - t0,
            "model": target.source, "drafter": drafter_label(drafter_cfg),
            "torch": torch.__version__, "transformers": transformers.__version__, "torch_threads": TORCH_THREADS,
            "plan": plan.model_dump(mode="json"), "config": args.config, "skipped": sorted(skip),
            "reused_sections": reused,
        },
        "sections": results,
    }


def run_command(args: argparse.Namespace) -> int:
    """`specserve bench` for parsed arguments; returns the exit status."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("bench %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if args.section == "reliability":
        from bench.reliability import main_section

        return main_section(args, command_line(args))
    if args.section == "vllm":
        from bench.vllm_peer import main_section

        return main_section(args, command_line(args))
    if args.section == "breakdown":
        from bench.breakdown import main_section

        return main_section(args, command_line(args))
    if args.section == "features":
        from bench.features import main_section

        return main_section(args, command_line(args))
    if args.section == "policy":
        from bench.policy_capacity import main_section

        return main_section(args, command_line(args))
    if args.section == "hub":
        from bench.hub_capacity import main_section

        return main_section(args, command_line(args))
    if args.section == "ramp":
        from bench.ramp import main_section

        return main_section(args, command_line(args))
    try:
        results = run(args)
    except ValueError as err:
        log.error("error: %s", err)
        return 2
    from bench.report import write_report

    out = Path(args.out or f"bench-out/{results['meta']['plan']['name']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report = write_report(results, out)
    log.info("wrote %s and %s", out / "results.json", report)
    for goal in results["goals"]:
        state = "not measured" if goal["met"] is None else ("met" if goal["met"] else "MISSED")
        log.info("  %-24s %s", goal["key"], state)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.run ...`: the same as `specserve bench ...`."""
    return run_command(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
