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
Requests are greedy token-id prompts in waves of N. Ratios and the report: `bench.vllm_report`.
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

from bench.vllm_report import report_markdown, results
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
# specserve's servers: name -> (the arms measured, as (label, arm) pairs). `specserve_asd` runs in `ngram` only.
SPECSERVE = {"specserve": (("specserve_exact", "exact"), ("specserve_asd", "asd")),
             "specserve_native": (("specserve_native_exact", "exact"),),
             "specserve_suffix": (("specserve_suffix_exact", "exact"),),
             "specserve_draft": (("specserve_draft_exact", "exact"),),
             "specserve_actor": (("specserve_actor_exact", "exact"),)}
# Sized for a 24 GiB machine: specserve's app and four vLLM servers exceeded it, and so did the two draft-model
# apps with two of vLLM's draft_model servers (each holds the model twice; Ray's memory monitor killed the apps'
# actors), so the draft groups hold one vLLM server each. specserve's servers that the next group also runs keep
# serving across it.
GROUPS = {"ngram": {"specserve": ("specserve", "specserve_native"), "vllm": ("vllm_plain", "vllm_ngram2")},
          "ngram_long": {"specserve": ("specserve", "specserve_native"), "vllm": ("vllm_ngram4", "vllm_ngram8")},
          "suffix": {"specserve": ("specserve", "specserve_native", "specserve_suffix"), "vllm": ("vllm_suffix",)},
          "draft": {"specserve": ("specserve_draft", "specserve_actor"), "vllm": ("vllm_draft2",)},
          "draft_mid": {"specserve": ("specserve_draft", "specserve_actor"), "vllm": ("vllm_draft4",)},
          "draft_long": {"specserve": ("specserve_draft", "specserve_actor"), "vllm": ("vllm_draft8",)}}
BENCH_KV_CACHE_BYTES = 1 << 30  # every vLLM engine's paged KV cache (both sides): 32 streams of 2k tokens fit
READY_TIMEOUT_S = 1800.0  # a first start compiles (~2 min alone on 2 cores; a cold group of four took > 15 min)
ACCEPT_METRICS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


@dataclass
class Server:
    name: str
    url: str
    model: str
    process: subprocess.Popen
    headers: dict


class MemoryWatch:
    """The machine's lowest available memory over a run (Linux /proc/meminfo, sampled each second; started at
    once), logged when it falls under `LOW_MEMORY_GIB`: there Ray's memory monitor (95% used) kills the servers'
    actors, and a figure measured then is not the server's."""

    LOW_MEMORY_GIB = 1.5

    def __init__(self):
        import threading

        self.min_available_gib: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-memory-watch")
        self._thread.start()

    @staticmethod
    def available_gib() -> float | None:
        try:
            line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
            return int(line.split()[1]) / (1 << 20)
        except (OSError, StopIteration):
            return None

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(1.0) and (gib := self.available_gib()) is not None:
            warned = self.min_available_gib is not None and self.min_available_gib < self.LOW_MEMORY_GIB
            if gib < self.LOW_MEMORY_GIB and not warned:
                log.warning("only %.1f GiB of memory available: Ray's memory monitor may kill the servers' actors, "
                            "and this run's figures may not be the servers' (run fewer --groups at once)", gib)
            self.min_available_gib = gib if self.min_available_gib is None else min(self.min_available_gib, gib)


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
    answers = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, [a[0] for a in answers], [a[1] for a in answers], [a[2] for a in answers]


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
    """Runs `groups` in order; returns `bench.vllm_report.results` of their cells."""
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
    watch = MemoryWatch()
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
        watch.stop()
        for server in peers + list(ours.values()):
            _stop(server)
    measured = results(cells, preset)
    measured["min_available_gib"] = watch.min_available_gib
    return measured


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
        measured = vllm_section(config, preset, out, groups)
    except ValueError as err:
        log.error("error: %s", err)
        return 2
    measured["meta"] = {"command": command, "started": started, "config": config, "groups": groups,
                       "preset": preset, "elapsed_s": time.monotonic() - t0,
                        "min_available_gib": measured.pop("min_available_gib")}
    (out / "results.json").write_text(json.dumps(measured, indent=1))
    (out / "report.md").write_text(report_markdown(measured))
    for name in ("vs_vllm", "vs_vllm_native", "vs_vllm_suffix", "vs_vllm_draft"):
        for key, value in sorted(measured["summary"].get(name, {}).items()):
            log.info("  %s %-18s %.2f %s", name, key, value, "met" if value >= 1.0 else "MISSED")
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0
