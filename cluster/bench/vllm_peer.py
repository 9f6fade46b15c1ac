"""`specserve bench --section vllm [--quick] [--out DIR] [CONFIG]`: specserve on the vLLM engine against vLLM's own
OpenAI server, on the same weights, dtype, engine settings and prompts.

Servers, each in its own process and all up at once (only the one being measured is busy):
- specserve: `specserve serve` on CONFIG (a `target.engine: vllm` config, default configs/local-vllm.yaml), both
  arms (exact, asd) through the `X-SpecServe-Arm` header, adaptive γ;
- vLLM plain, and vLLM's own `ngram` speculation at k = 2, 4 and 8 (its default n-gram window), each
  `python -m vllm.entrypoints.openai.api_server` with the engine keywords of CONFIG's `target.engine_kwargs`.

Every server gets the same greedy `/v1/completions` requests (token-id prompts from the benchmark workloads)
in waves of N requests sent together (N = 1 and 8). A repeat measures every (workload, load, server) once, the
server order rotating between repeats; a cell's tokens/s is Σ completion tokens / Σ wave wall time of its
fastest repeat. Summary keys: `vs_vllm` (specserve's exact arm / the best vLLM configuration for that workload
and load, chosen after the fact) and `vllm_asd_vs_exact` (the asd arm / the exact arm). vLLM counts the stop
token in `completion_tokens` and specserve does not, which favours vLLM by up to one token a request.
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

from cluster.experiments.ab import ARM_HEADER

log = logging.getLogger("specserve.bench")

PRESETS = {
    "quick": {"workloads": ("code", "edit", "summarization", "chat"), "prompts": 4, "max_tokens": 64,
              "repeats": 2, "loads": (1, 8)},
    "full": {"workloads": ("code", "edit", "summarization", "chat"), "prompts": 8, "max_tokens": 128,
             "repeats": 3, "loads": (1, 8)},
}
VLLM_PEERS = {"vllm_plain": None, "vllm_ngram2": 2, "vllm_ngram4": 4, "vllm_ngram8": 8}
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


def _vllm_command(config, model_dir: str, port: int, k: int | None) -> list[str]:
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
    if k is not None:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k})]
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

    from cluster.bench.workloads import cycle

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


def vllm_section(config_path: str, preset: dict, out: Path) -> dict:
    from actors.sources import load_tokenizer, resolve
    from cluster.bench.workloads import load_workload
    from cluster.config import load_config

    config = load_config(config_path)
    if config.target.engine != "vllm":
        raise ValueError(f"{config_path}: the vLLM peer section needs a config with target.engine 'vllm'")
    tokenizer = load_tokenizer(config.target.source)
    prompts = {w: load_workload(w, tokenizer, preset["prompts"]) for w in preset["workloads"]}
    model_dir = str(resolve(config.target.source))
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ours_port = _free_port()
    data = yaml.safe_load(Path(config_path).read_text())
    data.setdefault("serving", {}).update(port=ours_port, host="127.0.0.1")
    data.setdefault("autoscaling", {}).update(enabled=False, min_replicas=1, max_replicas=1)
    tmp = Path(tempfile.mkdtemp(prefix="specserve-vllm-bench-")) / "config.yaml"
    tmp.write_text(yaml.safe_dump(data))
    servers = []
    try:
        specserve = Path(sys.executable).with_name("specserve")
        ours = _start("specserve", [str(specserve), "serve", str(tmp)], f"http://127.0.0.1:{ours_port}",
                      config.target.served_name, logs)
        servers.append(ours)
        _wait_ready(ours)  # one start at a time: two compiles on two cores would each take twice as long
        for name, k in VLLM_PEERS.items():
            port = _free_port()
            server = _start(name, _vllm_command(config, model_dir, port, k), f"http://127.0.0.1:{port}",
                            config.target.served_name, logs)
            servers.append(server)
            _wait_ready(server)
        targets = [("specserve_exact", ours, "exact"), ("specserve_asd", ours, "asd")]
        targets += [(s.name, s, None) for s in servers[1:]]
        cells = _measure(targets, prompts, preset)
    finally:
        for server in servers:
            _stop(server)
    return _results(cells, preset)


def _results(cells: dict, preset: dict) -> dict:
    rows, vs_vllm, asd_vs_exact = [], {}, {}
    for workload in preset["workloads"]:
        for load in preset["loads"]:
            best = {label: max(cells[(workload, load, label)]["runs"])
                    for (w, c, label) in cells if w == workload and c == load}
            peer = max((label for label in best if label.startswith("vllm_")), key=best.get)
            plain_texts = cells[(workload, load, "vllm_plain")]["texts"]
            exact_texts = cells[(workload, load, "specserve_exact")]["texts"]
            agree = sum(a == b for a, b in zip(plain_texts, exact_texts)) / max(len(plain_texts), 1)
            key = f"{workload}@{load}"
            vs_vllm[key] = best["specserve_exact"] / best[peer]
            asd_vs_exact[key] = best["specserve_asd"] / best["specserve_exact"]
            rows.append({"workload": workload, "load": load, "tokens_per_s": best, "best_vllm": peer,
                         "vs_vllm": vs_vllm[key], "asd_vs_exact": asd_vs_exact[key],
                         "greedy_text_agreement": agree,
                         "runs": {label: cells[(workload, load, label)]["runs"] for label in best}})
    return {"summary": {"vs_vllm": vs_vllm, "vllm_asd_vs_exact": asd_vs_exact}, "rows": rows}


def report_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# specserve on vLLM vs vLLM's own server", "",
             f"- command: `{meta['command']}`", f"- started {meta['started']}, took {meta['elapsed_s']:.0f} s",
             f"- preset: {json.dumps(meta['preset'])}", "",
             "Output tokens/s, greedy `/v1/completions`, waves of N requests; the fastest repeat of each cell.", "",
             "| workload | N | specserve exact | specserve asd | vLLM plain | ngram k=2 | ngram k=4 | ngram k=8 | "
             "best vLLM | vs_vllm | asd / exact | greedy texts agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        t = row["tokens_per_s"]
        lines.append(f"| {row['workload']} | {row['load']} | {t['specserve_exact']:.1f} | {t['specserve_asd']:.1f} | "
                     f"{t['vllm_plain']:.1f} | {t['vllm_ngram2']:.1f} | {t['vllm_ngram4']:.1f} | "
                     f"{t['vllm_ngram8']:.1f} | {row['best_vllm']} | **{row['vs_vllm']:.2f}** | "
                     f"{row['asd_vs_exact']:.2f} | {row['greedy_text_agreement']:.0%} |")
    return "\n".join(lines) + "\n"


def main_section(args, argv: list[str]) -> int:
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
    results["meta"] = {"command": "specserve bench " + " ".join(shlex.quote(a) for a in argv), "started": started,
                       "config": config, "preset": preset, "elapsed_s": time.monotonic() - t0}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report_markdown(results))
    for key, value in sorted(results["summary"]["vs_vllm"].items()):
        log.info("  vs_vllm %-18s %.2f %s", key, value, "met" if value >= 1.0 else "MISSED")
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0
