"""`specserve bench --section vllm [--quick] [--out DIR] [CONFIG]`: specserve on the vLLM engine against vLLM's own
OpenAI server, on the same weights, dtype, engine settings and prompts.

Each server runs in its own process, in two groups (`GROUPS`), only the one being measured busy: specserve
(`specserve serve` on a `target.engine: vllm` CONFIG, default configs/local-vllm.yaml, both arms), the `ngram`
group (vLLM plain and its `ngram` speculation, `VLLM_PEERS`) and the `suffix` group (specserve's suffix drafter
against vLLM's `suffix` method, left out without the `arctic-inference` package). Cross-request suffix caches
are off on both sides. Requests are greedy token-id prompts in waves of N; every ratio divides two cells of one
group. Summary keys `vs_vllm`, `vs_vllm_suffix`, `vllm_asd_vs_exact`: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
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
              "repeats": 2, "loads": (1, 8)},
    "full": {"workloads": ("code", "edit", "summarization", "chat"), "prompts": 8, "max_tokens": 128,
             "repeats": 3, "loads": (1, 8)},
}
VLLM_PEERS = {"vllm_plain": None,
              "vllm_ngram2": {"method": "ngram", "num_speculative_tokens": 2},
              "vllm_ngram4": {"method": "ngram", "num_speculative_tokens": 4},
              "vllm_ngram8": {"method": "ngram", "num_speculative_tokens": 8},
              "vllm_suffix": {"method": "suffix", "suffix_decoding_max_cached_requests": 0}}
# Servers run group by group (all seven at once do not fit in 24 GiB); each group is measured interleaved
# with specserve's exact arm, which serves throughout.
GROUPS = {"ngram": ("vllm_plain", "vllm_ngram2", "vllm_ngram4", "vllm_ngram8"), "suffix": ("vllm_suffix",)}
READY_TIMEOUT_S = 900.0  # a first start compiles the model (~2 min on 2 cores) unless enforce_eager


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
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd


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
    async def one(prompt):
        body = {"model": server.model, "prompt": list(prompt.ids), "max_tokens": max_tokens, "temperature": 0}
        headers = {ARM_HEADER: arm} if arm else {}
        response = await client.post(f"{server.url}/v1/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.text[:300]}")
        data = response.json()
        return data["usage"]["completion_tokens"], data["choices"][0]["text"]

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, [n for n, _ in results], [t for _, t in results]


def _measure(targets: list[tuple[str, Server, str | None]], prompts_by_workload: dict, preset: dict) -> dict:
    """Every (workload, load, target) once per repeat, the target order rotating; waves of `load` requests."""
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
                            wall, tokens, texts = 0.0, 0, []
                            for wave in waves:
                                seconds, counts, outs = await _wave(client, server, wave, preset["max_tokens"], arm)
                                wall, tokens, texts = wall + seconds, tokens + sum(counts), texts + outs
                            cell = cells.setdefault((workload, load, label), {"runs": []})
                            cell["runs"].append(tokens / wall)
                            cell["texts"] = texts
                            log.info("  r%d %s c=%d %-14s %6.1f tok/s", repeat, workload, load, label, tokens / wall)

    asyncio.run(run())
    return cells


def _specserve_config(data: dict, port: int) -> Path:
    data = {**data, "serving": {**data.get("serving", {}), "port": port, "host": "127.0.0.1"}}
    path = Path(tempfile.mkdtemp(prefix="specserve-vllm-bench-")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def vllm_section(config_path: str, preset: dict, out: Path) -> dict:
    from actors.sources import load_tokenizer, resolve
    from bench.workloads import load_workload
    from cluster.config import load_config

    config = load_config(config_path)
    if config.target.engine != "vllm":
        raise ValueError(f"{config_path}: the vLLM peer section needs a config with target.engine 'vllm'")
    tokenizer = load_tokenizer(config.target.source)
    prompts = {w: load_workload(w, tokenizer, preset["prompts"]) for w in preset["workloads"]}
    model_dir = str(resolve(config.target.source))
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(Path(config_path).read_text())
    data.setdefault("autoscaling", {}).update(enabled=False, min_replicas=1, max_replicas=1)
    specserve = str(Path(sys.executable).with_name("specserve"))

    def start_specserve(name: str, variant: dict) -> Server:
        port = _free_port()
        # each in a Ray cluster of its own: a second `serve` would otherwise join the first one's cluster, and
        # its app of the same name would replace the first one's
        command = [specserve, "serve", "--address", "local", str(_specserve_config(variant, port))]
        server = _start(name, command, f"http://127.0.0.1:{port}", config.target.served_name, logs)
        _wait_ready(server)  # one start at a time: two compiles on two cores would each take twice as long
        return server

    def start_vllm(name: str) -> Server:
        port = _free_port()
        server = _start(name, _vllm_command(config, model_dir, port, VLLM_PEERS[name]), f"http://127.0.0.1:{port}",
                        config.target.served_name, logs)
        _wait_ready(server)
        return server

    cells, ours, started = {}, None, []
    try:
        ours = start_specserve("specserve", data)
        own = [("specserve_exact", ours, "exact")]
        for group, names in GROUPS.items():
            if group == "suffix" and not suffix_available():
                log.warning("vllm_suffix left out: vLLM's suffix method needs the arctic-inference package")
                continue
            targets = own + ([("specserve_asd", ours, "asd")] if group == "ngram" else [])
            if group == "suffix" and config.drafter.kind != "suffix":
                suffix = {**data, "drafter": {**data.get("drafter", {}), "kind": "suffix", "suffix_cache_tokens": 0}}
                started.append(start_specserve("specserve_suffix", suffix))
                targets.append(("specserve_suffix_exact", started[-1], "exact"))
            for name in names:
                started.append(start_vllm(name))
                targets.append((name, started[-1], None))
            cells[group] = _measure(targets, prompts, preset)
            while started:  # a group's servers stop before the next group's start: memory
                _stop(started.pop())
    finally:
        for server in started + ([ours] if ours else []):
            _stop(server)
    return _results(cells, preset)


def _results(cells: dict, preset: dict) -> dict:
    """Summary and rows from each group's cells ({group: {(workload, load, label): cell}}); every ratio divides
    two figures of the same group (measured interleaved)."""
    rows, vs_vllm, vs_suffix, asd_vs_exact = [], {}, {}, {}
    for workload in preset["workloads"]:
        for load in preset["loads"]:
            best = {group: {label: max(cell["runs"]) for (w, c, label), cell in by_cell.items()
                            if w == workload and c == load} for group, by_cell in cells.items()}
            ratios = {label: speeds["specserve_exact"] / speeds[label]
                      for speeds in best.values() for label in speeds if label.startswith("vllm_")}
            peer = min(ratios, key=ratios.get)  # the best vLLM configuration, after the fact
            key = f"{workload}@{load}"
            vs_vllm[key] = ratios[peer]
            ngram = best["ngram"]
            asd_vs_exact[key] = ngram["specserve_asd"] / ngram["specserve_exact"]
            plain_texts = cells["ngram"][(workload, load, "vllm_plain")]["texts"]
            agree = {}
            for group, by_cell in cells.items():
                for label in (label for label in best[group] if label.endswith("_exact")):
                    texts = by_cell[(workload, load, label)]["texts"]
                    agree[f"{group}/{label}"] = sum(a == b for a, b in zip(plain_texts, texts)) / max(len(texts), 1)
            row = {"workload": workload, "load": load, "tokens_per_s": best, "best_vllm": peer,
                   "vs_vllm": vs_vllm[key], "asd_vs_exact": asd_vs_exact[key], "greedy_text_agreement": agree,
                   "runs": {group: {label: by_cell[(workload, load, label)]["runs"] for label in best[group]}
                            for group, by_cell in cells.items()}}
            if "suffix" in best:
                speeds = best["suffix"]
                ours = speeds.get("specserve_suffix_exact", speeds["specserve_exact"])  # the config's drafter is suffix
                vs_suffix[key] = row["vs_vllm_suffix"] = ours / speeds["vllm_suffix"]
            rows.append(row)
    summary = {"vs_vllm": vs_vllm, "vllm_asd_vs_exact": asd_vs_exact}
    if vs_suffix:
        summary["vs_vllm_suffix"] = vs_suffix
    return {"summary": summary, "rows": rows}


COLUMNS = {"specserve_exact": "specserve exact", "specserve_asd": "specserve asd",
           "specserve_suffix_exact": "specserve suffix, exact", "vllm_plain": "vLLM plain",
           "vllm_ngram2": "ngram k=2", "vllm_ngram4": "ngram k=4", "vllm_ngram8": "ngram k=8",
           "vllm_suffix": "vLLM suffix"}


def report_markdown(results: dict) -> str:
    meta = results["meta"]
    groups = list(results["rows"][0]["tokens_per_s"])
    columns = [(g, c) for g in groups for c in COLUMNS if c in results["rows"][0]["tokens_per_s"][g]]
    suffix = "vs_vllm_suffix" in results["summary"]
    lines = ["# specserve on vLLM vs vLLM's own server", "",
             f"- command: `{meta['command']}`", f"- started {meta['started']}, took {meta['elapsed_s']:.0f} s",
             f"- preset: {json.dumps(meta['preset'])}", "",
             "Output tokens/s, greedy `/v1/completions`, waves of N requests; the fastest repeat of each cell. "
             "Servers run in groups (memory); a group's targets are measured interleaved, and every ratio "
             "divides two figures of one group: `ngram` = specserve and vLLM plain and ngram, `suffix` = "
             "specserve, specserve with the suffix drafter and vLLM suffix.",
             "Greedy texts agree: the share of requests whose text equals vLLM plain's, per specserve exact server.",
             "" if suffix else "vLLM's suffix method was not measured: the `arctic-inference` package is missing.", "",
             "| workload | N | " + " | ".join(f"{COLUMNS[c]} ({g})" for g, c in columns) + " | best vLLM | vs_vllm | "
             + ("vs_vllm_suffix | " if suffix else "") + "asd / exact | greedy texts agree |",
             "|---|---|" + "---|" * (len(columns) + 4 + suffix)]
    for row in results["rows"]:
        t = row["tokens_per_s"]
        agree = ", ".join(f"{a:.0%}" for a in row["greedy_text_agreement"].values())
        lines.append(f"| {row['workload']} | {row['load']} | " + " | ".join(f"{t[g][c]:.1f}" for g, c in columns)
                     + f" | {row['best_vllm']} | **{row['vs_vllm']:.2f}** | "
                     + (f"**{row['vs_vllm_suffix']:.2f}** | " if suffix else "")
                     + f"{row['asd_vs_exact']:.2f} | {agree} |")
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
    out = Path(args.out or f"bench-out/vllm-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)
    config = args.config if args.config != "configs/local.yaml" else "configs/local-vllm.yaml"
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    results = vllm_section(config, preset, out)
    results["meta"] = {"command": command, "started": started,
                       "config": config, "preset": preset, "elapsed_s": time.monotonic() - t0}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report_markdown(results))
    for name in ("vs_vllm", "vs_vllm_suffix"):
        for key, value in sorted(results["summary"].get(name, {}).items()):
            log.info("  %s %-18s %.2f %s", name, key, value, "met" if value >= 1.0 else "MISSED")
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0
