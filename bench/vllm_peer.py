"""`specserve bench --section vllm [--quick] [--groups G,...] [--loads N,...] [--out DIR] [CONFIG]`: specserve
against vLLM's own OpenAI server, on the same weights, dtype, engine settings and prompts.

Each server runs in its own process. Servers run in groups (`GROUPS`), at most a few at once (memory); a group's
targets are measured interleaved, only the one being measured busy, and every ratio divides two cells of one
group. specserve's servers (`SPECSERVE`) are `specserve serve` apps in Ray clusters of their own: the CONFIG
(`target.engine: vllm`, default configs/local-vllm.yaml, both arms), the native engine's app
(configs/local.yaml), and drafter variants of the CONFIG (suffix; vLLM's draft model in the worker; specserve's
separate drafter actor). vLLM's servers (`VLLM_PEERS`) are plain, `ngram` at k = 2, 4, 8, `suffix` (left out
without the `arctic-inference` package) and `draft_model` at k = 2, 4, 8 with the target drafting for itself.
Cross-request suffix caches are off on both sides, and every server gets `BENCH_KV_CACHE_BYTES` of KV cache.
Requests are greedy token-id prompts in waves of N. Summary keys `vs_vllm`, `vs_vllm_native`, `vs_vllm_suffix`,
`vs_vllm_draft`, `vllm_asd_vs_exact`, `drafter_placement`: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.serving.ab import ARM_HEADER

log = logging.getLogger("specserve.bench")

PRESETS = {
    "quick": {"workloads": ("code", "edit", "summarization", "chat"), "prompts": 4, "max_tokens": 64,
              "repeats": 2, "loads": (1, 8, 32)},
    "full": {"workloads": ("code", "edit", "summarization", "chat"), "prompts": 8, "max_tokens": 128,
             "repeats": 3, "loads": (1, 8, 32)},
}
VLLM_PEERS = {"vllm_plain": None,
              "vllm_ngram2": {"method": "ngram", "num_speculative_tokens": 2},
              "vllm_ngram4": {"method": "ngram", "num_speculative_tokens": 4},
              "vllm_ngram8": {"method": "ngram", "num_speculative_tokens": 8},
              "vllm_suffix": {"method": "suffix", "suffix_decoding_max_cached_requests": 0},
              # the target drafting for itself (`model` is filled in with the target's folder)
              "vllm_draft2": {"method": "draft_model", "num_speculative_tokens": 2},
              "vllm_draft4": {"method": "draft_model", "num_speculative_tokens": 4},
              "vllm_draft8": {"method": "draft_model", "num_speculative_tokens": 8}}
# What `vs_vllm` and `vs_vllm_native` divide by: vLLM without a draft model (the best of them, after the fact).
MODEL_FREE_PEERS = ("vllm_plain", "vllm_ngram2", "vllm_ngram4", "vllm_ngram8", "vllm_suffix")
DRAFT_PEERS = ("vllm_draft2", "vllm_draft4", "vllm_draft8")
# specserve's servers: name -> (the arms measured, as (label, arm) pairs). `specserve_asd` runs in `ngram` only.
SPECSERVE = {"specserve": (("specserve_exact", "exact"), ("specserve_asd", "asd")),
             "specserve_native": (("specserve_native_exact", "exact"),),
             "specserve_suffix": (("specserve_suffix_exact", "exact"),),
             "specserve_draft": (("specserve_draft_exact", "exact"),),
             "specserve_actor": (("specserve_actor_exact", "exact"),)}
# At most five servers at once: specserve's app and four vLLM servers exceeded 24 GiB (Ray's memory monitor
# killed the app). specserve's servers that the next group also runs keep serving across it.
GROUPS = {"ngram": {"specserve": ("specserve", "specserve_native"), "vllm": ("vllm_plain", "vllm_ngram2")},
          "ngram_long": {"specserve": ("specserve", "specserve_native"), "vllm": ("vllm_ngram4", "vllm_ngram8")},
          "suffix": {"specserve": ("specserve", "specserve_native", "specserve_suffix"), "vllm": ("vllm_suffix",)},
          "draft": {"specserve": ("specserve_draft", "specserve_actor"), "vllm": ("vllm_draft2", "vllm_draft4")},
          "draft_long": {"specserve": ("specserve_draft", "specserve_actor"), "vllm": ("vllm_draft8",)}}
BENCH_KV_CACHE_BYTES = 1 << 30  # every vLLM engine's paged KV cache (both sides): 32 streams of 2k tokens fit
READY_TIMEOUT_S = 900.0  # a first start compiles the model (~2 min on 2 cores) unless enforce_eager
ACCEPT_METRICS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


@dataclass
class Server:
    name: str
    url: str
    model: str
    process: subprocess.Popen
    headers: dict


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def suffix_available() -> bool:
    """Whether vLLM's suffix method can run here (it imports `arctic_inference`)."""
    import importlib.util

    return importlib.util.find_spec("arctic_inference") is not None


def _vllm_command(config, model_dir: str, port: int, speculative: dict | None) -> list[str]:
    """vLLM's OpenAI server on the config's target settings; `speculative` is vLLM's `--speculative-config`."""
    target = config.target
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", target.served_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", target.dtype, "--max-model-len", str(target.max_seq_len or 2048), "--seed", "0",
           "--max-num-seqs", str(target.max_batch_size)]
    for key, value in target.engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False:
            cmd += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    if speculative is not None:
        if speculative["method"] == "draft_model":
            speculative = {**speculative, "model": model_dir}
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd


def specserve_variants(data: dict, native: dict) -> dict[str, dict]:
    """Each `SPECSERVE` server's config (as YAML data) from the CONFIG's and the native app's: one replica each,
    and the drafter variants drafting with the target's own weights."""
    source = data["target"]["source"]
    drafter = data.get("drafter", {})
    variants = {
        "specserve": data,
        "specserve_native": native,
        "specserve_suffix": {**data, "drafter": {**drafter, "kind": "suffix", "suffix_cache_tokens": 0}},
        "specserve_draft": {**data, "drafter": {"kind": "vllm", "method": "draft_model", "source": source}},
        # the design's drafter actor, in the same Ray cluster as the unit: no CPU reserved (two cores in all)
        "specserve_actor": {**data, "drafter": {"kind": "model", "source": source, "dtype": data["target"]["dtype"],
                                                "resources": {"num_cpus": 0, "num_gpus": 0}}},
    }
    for name, variant in variants.items():
        variants[name] = {**variant, "autoscaling": {**variant.get("autoscaling", {}), "enabled": False,
                                                     "min_replicas": 1, "max_replicas": 1}}
        if variant["target"].get("engine") == "vllm":
            kwargs = {**variant["target"].get("engine_kwargs", {}), "kv_cache_memory_bytes": BENCH_KV_CACHE_BYTES}
            variants[name]["target"] = {**variant["target"], "engine_kwargs": kwargs}
    return variants


def _start(name: str, cmd: list[str], url: str, model: str, logs: Path, headers=None, env=None) -> Server:
    log.info("starting %s: %s", name, " ".join(shlex.quote(c) for c in cmd[:6]) + " ...")
    out = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(name, url, model, process, headers or {})


def _wait_ready(server: Server) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode} before it was ready")
        try:
            if httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise RuntimeError(f"{server.name} was not ready after {READY_TIMEOUT_S:.0f} s")


def _stop(server: Server) -> None:
    import signal

    try:
        os.killpg(server.process.pid, signal.SIGINT)
        server.process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(server.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _wave(client, server: Server, prompts, max_tokens: int, arm: str | None):
    """One wave of concurrent greedy requests: (seconds, token counts, texts, each answer's
    `usage.speculative` or None)."""
    async def one(prompt):
        body = {"model": server.model, "prompt": list(prompt.ids), "max_tokens": max_tokens, "temperature": 0}
        headers = {ARM_HEADER: arm} if arm else {}
        response = await client.post(f"{server.url}/v1/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.text[:300]}")
        data = response.json()
        return data["usage"]["completion_tokens"], data["choices"][0]["text"], data["usage"].get("speculative")

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


async def _vllm_acceptance(client, server: Server) -> tuple[float, float] | None:
    """vLLM's own counters of drafted and accepted tokens (its /metrics), summed over series; None without."""
    text = (await client.get(f"{server.url}/metrics")).text
    totals = []
    for name in ACCEPT_METRICS:
        values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
        if not values:
            return None
        totals.append(sum(values))
    return totals[0], totals[1]


def _measure(targets: list[tuple[str, Server, str | None]], prompts_by_workload: dict, preset: dict) -> dict:
    """Every (workload, load, target) once per repeat, the target order rotating; waves of `load` requests.

    A cell keeps tokens/s per repeat (`runs`), the last repeat's texts, the acceptance of its drafts (specserve's
    `usage.speculative`, vLLM's /metrics counters) and, for specserve, seconds per step: a wave's wall time over
    its longest request's rounds."""
    import httpx

    from bench.workloads import cycle

    cells: dict = {}

    async def run():
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=64)) as client:
            for label, server, arm in targets:  # warm-up: one request each
                await _wave(client, server, list(prompts_by_workload.values())[0][:1], 8, arm)
            for repeat in range(preset["repeats"]):
                for workload, prompts in prompts_by_workload.items():
                    for load in preset["loads"]:
                        batch = prompts if load == 1 else cycle(prompts, max(load, len(prompts)))
                        waves = [batch[i : i + load] for i in range(0, len(batch), load)]
                        shift = repeat % len(targets)
                        for label, server, arm in targets[shift:] + targets[:shift]:
                            wall, tokens, texts, rounds, drafted, accepted = 0.0, 0, [], 0, 0.0, 0.0
                            before = None if arm else await _vllm_acceptance(client, server)
                            for wave in waves:
                                seconds, counts, outs, usage = await _wave(client, server, wave, preset["max_tokens"],
                                                                           arm)
                                wall, tokens, texts = wall + seconds, tokens + sum(counts), texts + outs
                                spec = [u for u in usage if u]
                                rounds += max((u["rounds"] for u in spec), default=0)
                                drafted += sum(u["draft_tokens"] for u in spec)
                                accepted += sum(u["accepted_tokens"] for u in spec)
                            if before is not None:
                                after = await _vllm_acceptance(client, server)
                                drafted, accepted = after[0] - before[0], after[1] - before[1]
                            cell = cells.setdefault((workload, load, label), {"runs": []})
                            cell["runs"].append(tokens / wall)
                            cell["texts"] = texts
                            cell["acceptance"] = accepted / drafted if drafted else None
                            if rounds:
                                cell.setdefault("step_s", []).append(wall / rounds)
                            log.info("  r%d %s c=%d %-22s %6.1f tok/s", repeat, workload, load, label, tokens / wall)

    asyncio.run(run())
    return cells


def _specserve_config(data: dict, port: int) -> Path:
    data = {**data, "serving": {**data.get("serving", {}), "port": port, "host": "127.0.0.1"}}
    path = Path(tempfile.mkdtemp(prefix="specserve-vllm-bench-")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def vllm_section(config_path: str, preset: dict, out: Path, groups: tuple[str, ...] = tuple(GROUPS),
                 native_config: str = "configs/local.yaml") -> dict:
    """Runs `groups` in order; returns `_results` of their cells."""
    from actors.sources import load_tokenizer, resolve
    from bench.workloads import load_workload
    from cluster.config import parse_config

    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise ValueError(f"groups: unknown {unknown} (known: {', '.join(GROUPS)})")
    data = yaml.safe_load(Path(config_path).read_text())
    variants = specserve_variants(data, yaml.safe_load(Path(native_config).read_text()))
    config = parse_config(variants["specserve"], config_path)  # the peers' settings: the bench's KV cache included
    if config.target.engine != "vllm":
        raise ValueError(f"{config_path}: the vLLM peer section needs a config with target.engine 'vllm'")
    tokenizer = load_tokenizer(config.target.source)
    prompts = {w: load_workload(w, tokenizer, preset["prompts"]) for w in preset["workloads"]}
    model_dir = str(resolve(config.target.source))
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    specserve = str(Path(sys.executable).with_name("specserve"))

    def start_specserve(name: str) -> Server:
        port = _free_port()
        variant = variants[name]
        # each in a Ray cluster of its own: a second `serve` would otherwise join the first one's cluster, and
        # its app of the same name would replace the first one's
        command = [specserve, "serve", "--address", "local", str(_specserve_config(variant, port))]
        server = _start(name, command, f"http://127.0.0.1:{port}", variant["target"]["served_name"], logs)
        _wait_ready(server)  # one start at a time: two compiles on two cores would each take twice as long
        return server

    def start_vllm(name: str) -> Server:
        port = _free_port()
        server = _start(name, _vllm_command(config, model_dir, port, VLLM_PEERS[name]), f"http://127.0.0.1:{port}",
                        config.target.served_name, logs)
        _wait_ready(server)
        return server

    cells, ours, peers = {}, {}, []
    try:
        for group in groups:
            if group == "suffix" and not suffix_available():
                log.warning("vllm_suffix left out: vLLM's suffix method needs the arctic-inference package")
                continue
            wanted = [n for n in GROUPS[group]["specserve"]
                      if not (n == "specserve_suffix" and config.drafter.kind == "suffix")]
            for name in [n for n in ours if n not in wanted]:  # memory: only this group's servers run
                _stop(ours.pop(name))
            targets = []
            for name in wanted:
                if name not in ours:
                    ours[name] = start_specserve(name)
                targets += [(label, ours[name], arm) for label, arm in SPECSERVE[name]
                            if label != "specserve_asd" or group == "ngram"]
            for name in GROUPS[group]["vllm"]:
                peers.append(start_vllm(name))
                targets.append((name, peers[-1], None))
            cells[group] = _measure(targets, prompts, preset)
            while peers:
                _stop(peers.pop())
    finally:
        for server in peers + list(ours.values()):
            _stop(server)
    return _results(cells, preset)


def _best_ratio(best: dict, ours: str, peers) -> tuple[float, str] | None:
    """(min over groups and peers of ours / peer, that peer): specserve against the best of `peers`, each ratio
    within one group; None where no group ran both."""
    ratios = {(group, peer): speeds[ours] / speeds[peer] for group, speeds in best.items() if ours in speeds
              for peer in peers if peer in speeds}
    if not ratios:
        return None
    group, peer = min(ratios, key=ratios.get)
    return ratios[(group, peer)], peer


def _results(cells: dict, preset: dict) -> dict:
    """Summary and rows from each group's cells ({group: {(workload, load, label): cell}}); every ratio divides
    two figures of the same group (measured interleaved). A summary key is present where it was measured."""
    rows, summary = [], {}
    for workload in preset["workloads"]:
        for load in preset["loads"]:
            key = f"{workload}@{load}"
            here = {group: {label: cell for (w, c, label), cell in by_cell.items() if w == workload and c == load}
                    for group, by_cell in cells.items()}
            best = {group: {label: max(cell["runs"]) for label, cell in by_label.items()}
                    for group, by_label in here.items()}
            row = {"workload": workload, "load": load, "tokens_per_s": best}
            for name, ours, peers in (("vs_vllm", "specserve_exact", MODEL_FREE_PEERS),
                                      ("vs_vllm_native", "specserve_native_exact", MODEL_FREE_PEERS),
                                      ("vs_vllm_draft", "specserve_draft_exact", DRAFT_PEERS)):
                found = _best_ratio(best, ours, peers)
                if found:
                    summary.setdefault(name, {})[key], row[f"best_{name}"] = found
                    row[name] = found[0]
            if "suffix" in best:
                speeds = best["suffix"]
                ours = speeds.get("specserve_suffix_exact", speeds["specserve_exact"])  # the config's drafter is suffix
                summary.setdefault("vs_vllm_suffix", {})[key] = row["vs_vllm_suffix"] = ours / speeds["vllm_suffix"]
            if "specserve_asd" in best.get("ngram", {}):
                ngram = best["ngram"]
                summary.setdefault("vllm_asd_vs_exact", {})[key] = row["asd_vs_exact"] = (
                    ngram["specserve_asd"] / ngram["specserve_exact"])
            placement = {group: speeds for group, speeds in best.items()
                         if {"specserve_draft_exact", "specserve_actor_exact"} <= set(speeds)}
            if placement:
                group, speeds = next(iter(placement.items()))
                cell = here[group]
                row["drafter_placement"] = summary.setdefault("drafter_placement", {})[key] = {
                    "in_worker_tok_s": speeds["specserve_draft_exact"], "actor_tok_s": speeds["specserve_actor_exact"],
                    "in_worker_vs_actor": speeds["specserve_draft_exact"] / speeds["specserve_actor_exact"],
                    "in_worker_step_s": min(cell["specserve_draft_exact"].get("step_s") or [float("nan")]),
                    "actor_step_s": min(cell["specserve_actor_exact"].get("step_s") or [float("nan")])}
            row["acceptance"] = {group: {label: cell.get("acceptance") for label, cell in by_label.items()}
                                 for group, by_label in here.items()}
            row["greedy_text_agreement"] = _agreement(here)
            row["runs"] = {group: {label: cell["runs"] for label, cell in by_label.items()}
                           for group, by_label in here.items()}
            rows.append(row)
    return {"summary": summary, "rows": rows}


def _agreement(here: dict) -> dict:
    """Per specserve exact server, the share of its texts equal to vLLM plain's (else to its group's first vLLM
    server's, which is named)."""
    plain = next((by_label["vllm_plain"]["texts"] for by_label in here.values() if "vllm_plain" in by_label), None)
    agree = {}
    for group, by_label in here.items():
        reference, name = plain, "vllm_plain"
        if reference is None:
            name = next(label for label in by_label if label.startswith("vllm_"))
            reference = by_label[name]["texts"]
        for label in (label for label in by_label if label.endswith("_exact")):
            texts = by_label[label]["texts"]
            suffix = "" if name == "vllm_plain" else f" vs {name}"
            agree[f"{group}/{label}{suffix}"] = sum(a == b for a, b in zip(reference, texts)) / max(len(texts), 1)
    return agree


COLUMNS = {"specserve_exact": "specserve exact", "specserve_asd": "specserve asd",
           "specserve_native_exact": "specserve native, exact", "specserve_suffix_exact": "specserve suffix, exact",
           "specserve_draft_exact": "specserve draft in worker, exact",
           "specserve_actor_exact": "specserve drafter actor, exact", "vllm_plain": "vLLM plain",
           "vllm_ngram2": "ngram k=2", "vllm_ngram4": "ngram k=4", "vllm_ngram8": "ngram k=8",
           "vllm_suffix": "vLLM suffix", "vllm_draft2": "draft k=2", "vllm_draft4": "draft k=4",
           "vllm_draft8": "draft k=8"}
RATIOS = ("vs_vllm", "vs_vllm_native", "vs_vllm_suffix", "vs_vllm_draft", "asd_vs_exact")


def report_markdown(results: dict) -> str:
    """Tokens/s per group (with acceptance), then the ratios per workload and load."""
    meta, rows = results["meta"], results["rows"]
    lines = ["# specserve vs vLLM's own server", "",
             f"- command: `{meta['command']}`", f"- started {meta['started']}, took {meta['elapsed_s']:.0f} s",
             f"- preset: {json.dumps(meta['preset'])}", "",
             "Output tokens/s, greedy `/v1/completions`, waves of N requests; the fastest repeat of each cell, with "
             "the acceptance of its drafts in parentheses. Servers run in groups (memory); a group's targets are "
             "measured interleaved, and every ratio divides two figures of one group.", ""]
    for group in rows[0]["tokens_per_s"]:
        labels = [c for c in COLUMNS if c in rows[0]["tokens_per_s"][group]]
        lines += [f"## Group `{group}`", "", "| workload | N | " + " | ".join(COLUMNS[c] for c in labels) + " |",
                  "|---|---|" + "---|" * len(labels)]
        for row in rows:
            cells = []
            for label in labels:
                accept = row["acceptance"][group][label]
                cells.append(f"{row['tokens_per_s'][group][label]:.1f}" + (f" ({accept:.0%})" if accept is not None
                                                                           else ""))
            lines.append(f"| {row['workload']} | {row['load']} | " + " | ".join(cells) + " |")
        lines.append("")
    present = [r for r in RATIOS if any(r in row for row in rows)]
    placement = any("drafter_placement" in row for row in rows)
    lines += ["## Ratios", "",
              "`vs_vllm` and `vs_vllm_native` divide by the best vLLM server without a draft model, `vs_vllm_draft` "
              "by vLLM's best draft_model k (named); greedy texts agree: the share of requests whose text equals "
              "vLLM plain's, per specserve exact server.", "",
              "| workload | N | " + " | ".join(present) + (" | draft in worker / actor (s per step) |" if placement
                                                             else " |") + " greedy texts agree |",
              "|---|---|" + "---|" * (len(present) + placement + 1)]
    for row in rows:
        cells = []
        for name in present:
            if name not in row:
                cells.append("–")
                continue
            peer = row.get(f"best_{name}")
            figure = f"{row[name]:.2f}" if name == "asd_vs_exact" else f"**{row[name]:.2f}**"
            cells.append(figure + (f" ({peer})" if peer else ""))
        if placement:
            p = row.get("drafter_placement")
            cells.append(f"{p['in_worker_vs_actor']:.2f} ({p['in_worker_step_s']:.3f} / {p['actor_step_s']:.3f})"
                         if p else "–")
        agree = ", ".join(f"{a:.0%}" for a in row["greedy_text_agreement"].values())
        lines.append(f"| {row['workload']} | {row['load']} | " + " | ".join(cells) + f" | {agree} |")
    return "\n".join(lines) + "\n"


def main_section(args, command: str) -> int:
    from datetime import datetime, timezone

    preset_name = "quick" if args.quick else "full"
    preset = dict(PRESETS[preset_name])
    if args.workloads:
        preset["workloads"] = tuple(args.workloads.split(","))
    for key in ("prompts", "max_tokens", "repeats"):
        if getattr(args, key, None):
            preset[key] = getattr(args, key)
    if getattr(args, "loads", None):
        preset["loads"] = tuple(int(n) for n in args.loads.split(","))
    groups = tuple(args.groups.split(",")) if getattr(args, "groups", None) else tuple(GROUPS)
    out = Path(args.out or f"bench-out/vllm-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)
    config = args.config if args.config != "configs/local.yaml" else "configs/local-vllm.yaml"
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    try:
        results = vllm_section(config, preset, out, groups)
    except ValueError as err:
        log.error("error: %s", err)
        return 2
    results["meta"] = {"command": command, "started": started, "config": config, "groups": groups,
                       "preset": preset, "elapsed_s": time.monotonic() - t0}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report_markdown(results))
    for name in ("vs_vllm", "vs_vllm_native", "vs_vllm_suffix", "vs_vllm_draft"):
        for key, value in sorted(results["summary"].get(name, {}).items()):
            log.info("  %s %-18s %.2f %s", name, key, value, "met" if value >= 1.0 else "MISSED")
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0
