"""The native engine on a GPU, checked and measured in one run; writes one JSON file.

    python scripts/gpu_check.py --out gpu_check.json           # on the GPU machine
    python scripts/gpu_check.py --smoke --out /tmp/smoke.json  # tiny shapes on the CPU (tests run it)

Needs only torch and the project's torch-only modules (no Ray, no model files: models get random weights).
One JSON section per method of `Check` (copy_bandwidth, attention, decode, verify_cost, greedy_identity,
verifiers, decode_variants); a failing one records its error and the others still run. The goals they are
judged against are `goals` (the README, "GPU: the native engine on a device"). The file is rewritten after every
section, so a run stopped at a time limit keeps the sections it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _stand_in_for_pydantic() -> None:
    """The GPU machine has torch, numpy and safetensors but maybe not pydantic, which the project uses only to
    validate `ASDConfig`'s fields; without it, ASDConfig becomes a plain frozen dataclass (the configs built
    here are valid)."""
    try:
        import pydantic  # noqa: F401
    except ImportError:
        import dataclasses
        import types

        stand_in = types.ModuleType("pydantic")
        # Field(default, ...) keeps its default (ASDConfig.gate has one); Field(...) alone is a required field
        stand_in.Field = lambda *args, **kwargs: (dataclasses.field(default=args[0]) if args and args[0] is not ...
                                                  else dataclasses.field())
        stand_in.dataclasses = types.ModuleType("pydantic.dataclasses")
        stand_in.dataclasses.dataclass = dataclasses.dataclass
        sys.modules["pydantic"], sys.modules["pydantic.dataclasses"] = stand_in, stand_in.dataclasses


_stand_in_for_pydantic()

from actors.contracts import TargetBatch  # noqa: E402
from actors.coordinator import Coordinator, GenerationRequest, SamplingParams  # noqa: E402
from actors.drafting import ModelDrafter  # noqa: E402
from actors.engines.native import Engine  # noqa: E402
from actors.engines.native.model import CausalLM, ModelArgs  # noqa: E402
from actors.policy import PolicyCore  # noqa: E402
from actors.sampling import SamplingSpec  # noqa: E402
from actors.scoring import score_round  # noqa: E402
from policies.asd import ASDConfig, verify_asd_scores  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=8192)
SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2,
             head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=2048)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512)
GOALS = {"decode_b1_bandwidth_use": 0.60, "v4_b1": 1.15}


class Check:
    def __init__(self, smoke: bool, budget_s: float, out: Path | None = None):
        self.smoke, self.out = smoke, out
        self.device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
        self.budget_s, self.t0 = budget_s, time.perf_counter()
        self.sections: dict[str, dict] = {}
        self.graphs = True  # on the CPU the fixed-shape path runs without capture
        big = TINY if smoke else LLAMA3_8B
        self.big_args = ModelArgs(**big)
        self.small_args = ModelArgs(**(TINY if smoke else SMALL))
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.prompt_len = 16 if smoke else 128
        self.steps = 4 if smoke else 128
        self.max_seq_len = 128 if smoke else 1024
        self.big: CausalLM | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, name: str, fn, optional: bool = False) -> None:
        if optional and self.elapsed() > 0.75 * self.budget_s:
            self.sections[name] = {"skipped": f"time budget: {self.elapsed():.0f} s of {self.budget_s:.0f} s used"}
            return
        start = time.perf_counter()
        try:
            self.sections[name] = fn()
        except Exception as exc:  # one failing section must not cost the others
            self.sections[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        self.sections[name]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"[{self.elapsed():6.1f}s] {name}: {json.dumps(self.sections[name])[:400]}", flush=True)
        if self.out is not None:  # after every section: a run stopped at its time limit keeps what it measured
            self.out.write_text(json.dumps(self.report(), indent=2, default=str))

    def report(self) -> dict:
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "smoke": self.smoke,
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "goals": goals(self.sections), "elapsed_s": round(self.elapsed(), 1), "sections": self.sections,
        }

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # --- models ----------------------------------------------------------------------------------------
    def model(self, args: ModelArgs, dtype: torch.dtype, seed: int) -> CausalLM:
        """A random-weight CausalLM built on the device (weights N(0, 0.02), norms 1)."""
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
        with torch.device("meta"):
            model = CausalLM(args, inv_freq).to(dtype)
        model = model.to_empty(device=self.device).eval().requires_grad_(False)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        model.inv_freq = inv_freq.to(self.device)
        return model.fuse_projections()

    def engine(self, model: CausalLM, graphs: bool | None = None, max_slots: int = 32,
               compiled: bool | None = None) -> Engine:
        return Engine(model, max_slots=max_slots, max_seq_len=self.max_seq_len,
                      graphs=self.graphs if graphs is None else graphs, preallocate=True, compiled=compiled)

    def prompts(self, batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, self.prompt_len), generator=gen).tolist()

    # --- sections --------------------------------------------------------------------------------------
    def copy_bandwidth(self) -> dict:
        """Device-to-device copy, (bytes read + written) / time: the ceiling for a decode step."""
        size = (2 << 30) if self.device.type == "cuda" else (64 << 20)
        src = torch.empty(size, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        self.sync()
        n, start = 10, time.perf_counter()
        for _ in range(n):
            dst.copy_(src)
        self.sync()
        seconds = (time.perf_counter() - start) / n
        self.copy_bw = 2 * size / seconds
        return {"bytes": size, "GB_per_s": round(self.copy_bw / 1e9, 1)}

    def attention(self) -> dict:
        """An eager decode and verify forward with SDPA's math backend disabled (raises if no fused kernel
        applies), and the attention kernels the profiler sees."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        model = self.big_model()
        engine = self.engine(model, graphs=False, max_slots=2)
        out = {}
        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        engine.forward(["a"], self.prompts(1, model.args.vocab_size), [1])
        for name, tokens in (("decode", [[1]]), ("verify", [[1, 2, 3, 4, 5]])):
            try:
                with sdpa_kernel(fused):
                    engine.forward(["a"], tokens, [len(tokens[0])])
                self.sync()
                out[f"{name}_fused_kernel"] = True
            except RuntimeError as exc:
                out[f"{name}_fused_kernel"], out[f"{name}_error"] = False, str(exc)[:300]
        if self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.forward(["a"], [[7]], [1])
                self.sync()
            names = {e.key for e in prof.key_averages()}
            out["attention_kernels"] = sorted(n[:120] for n in names if any(
                w in n.lower() for w in ("attention", "fmha", "flash", "cudnn", "sdpa", "softmax")))
        return out

    def big_model(self) -> CausalLM:
        if self.big is None:
            self.big = self.model(self.big_args, self.dtype, seed=1)
        return self.big

    def step_bytes(self, model: CausalLM, lengths: list[int]) -> int:
        """Bytes a decode step reads: every weight but the embedding table, plus each row's cached keys/values."""
        a = model.args
        weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
        kv_per_position = 2 * a.num_layers * a.num_kv_heads * a.head_dim * model.dtype.itemsize
        return weights + kv_per_position * sum(lengths)

    def decode_rate(self, engine: Engine, batch: int, steps: int, through_host: bool = False) -> dict:
        ids = [f"r{b}" for b in range(batch)]
        for sid in list(engine.active_ids()):
            engine.release(sid)
        logits = engine.forward(ids, self.prompts(batch, engine.vocab_size), [1] * batch)
        tokens = logits[:, 0].argmax(-1)[:, None]  # [B, 1] on the device
        warm = 2 if self.smoke else 8
        host_s = 0.0
        for i in range(warm + steps):
            if i == warm:
                self.sync()
                start = time.perf_counter()
                host_s = 0.0
            t = time.perf_counter()
            fed = tokens.tolist() if through_host else tokens  # the coordinator's way: one sync per step
            logits = engine.forward(ids, fed, [1] * batch)
            host_s += time.perf_counter() - t
            tokens = logits[:, 0].argmax(-1)[:, None]
        self.sync()
        step_s = (time.perf_counter() - start) / steps
        lengths = [engine.length(i) for i in ids]
        out = {"batch": batch, "step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(batch / step_s, 1),
               "host_ms_per_step": round(host_s / steps * 1e3, 3)}
        if not through_host and hasattr(self, "copy_bw"):
            out["bandwidth_use"] = round(self.step_bytes(engine.model, lengths) / step_s / self.copy_bw, 3)
        return out

    def decode(self) -> dict:
        """A Llama-3-8B-shaped model: tokens/s at batch 1, 8, 32 (CUDA graphs, tokens fed back on the device, and
        at batch 1 through the host as the coordinator does), host time per step, and bandwidth use = bytes of
        weights and KV read per step / step time / copy bandwidth."""
        model = self.big_model()
        engine = self.engine(model)
        out = {"model": f"{'tiny' if self.smoke else 'llama-3-8b'} shapes, random weights", "dtype": str(self.dtype),
               "graphs": self.graphs, "pointwise_compiled": engine.compiled,
               "prompt_tokens": self.prompt_len, "steps": self.steps}
        for batch in (1, 8, 32):
            out[f"b{batch}"] = self.decode_rate(engine, batch, self.steps)
        out["b1_through_host"] = self.decode_rate(engine, 1, self.steps // 2, through_host=True)
        out["captures"] = engine.static.captures if engine.static else 0
        return out

    def decode_variants(self) -> dict:
        """Batch-1 decode of a second, never-compiled copy of the model (the Engine's default compiles the
        pointwise functions on CUDA): with graphs, and eager."""
        model = self.model(self.big_args, self.dtype, seed=1)
        out = {"b1_graphs_uncompiled": self.decode_rate(self.engine(model, max_slots=2, compiled=False), 1,
                                                        self.steps),
               "b1_eager_uncompiled": self.decode_rate(self.engine(model, graphs=False, max_slots=2, compiled=False),
                                                       1, max(2, self.steps // 4))}
        del model
        return out

    def verify_cost(self) -> dict:
        """v(γ) = time of a forward of γ + 1 tokens / time of one token, γ = 1..8, at batch 1 and 16."""
        model = self.big_model()
        engine = self.engine(model)
        out = {}
        for batch in (1, 16):
            ids = [f"v{b}" for b in range(batch)]
            for sid in list(engine.active_ids()):
                engine.release(sid)
            engine.forward(ids, self.prompts(batch, model.args.vocab_size), [1] * batch)
            base = self.prompt_len
            times = {}
            for tokens in range(1, 10):
                block = [[3] * tokens] * batch
                reps = 2 if self.smoke else 20
                for i in range(3 + reps):
                    if i == 3:
                        self.sync()
                        start = time.perf_counter()
                    for sid in ids:
                        engine.crop(sid, base)
                    engine.forward(ids, block, [tokens] * batch)
                self.sync()
                times[tokens] = (time.perf_counter() - start) / reps
            out[f"b{batch}"] = {"one_token_ms": round(times[1] * 1e3, 3),
                                "v": {g: round(times[g + 1] / times[1], 3) for g in range(1, 9)}}
        return out

    def greedy_identity(self) -> dict:
        """A small random model drafting for itself (same weights): speculative greedy must equal target-only
        greedy and α must be 1 in float32; in bfloat16 the agreement is reported."""
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = self.model(self.small_args, dtype, seed=2)
            prompts = self.prompts(4, model.args.vocab_size, seed=3)
            params = SamplingParams(max_tokens=8 if self.smoke else 64, ignore_eos=True)

            def run(drafter, gamma):
                unit = Coordinator.local(self.engine(model, max_slots=8), drafter, PolicyCore(fixed_gamma=gamma))
                return unit.generate_many_sync([GenerationRequest(f"q{i}", p, params) for i, p in enumerate(prompts)])

            plain = run(None, 0)
            spec = run(ModelDrafter(self.engine(model, max_slots=8)), 4)
            drafted = sum(r.record.draft_tokens for r in spec)
            accepted = sum(r.record.accepted_tokens for r in spec)
            same = [a.token_ids == b.token_ids for a, b in zip(plain, spec)]
            agree = [sum(x == y for x, y in zip(a.token_ids, b.token_ids)) / len(a.token_ids)
                     for a, b in zip(plain, spec)]
            out[str(dtype).removeprefix("torch.")] = {
                "identical": all(same), "alpha": round(accepted / max(1, drafted), 4),
                "token_agreement": round(sum(agree) / len(agree), 4), "rounds": sum(r.record.rounds for r in spec)}
        return out

    def verifiers(self) -> dict:
        """The target's device-side scoring round (greedy; sampled) and ASD on the host, at the large vocabulary."""
        vocab = self.big_args.vocab_size
        out = {}
        gen = torch.Generator(device=self.device).manual_seed(4)
        config = ASDConfig(g=2.0, max_relaxed_per_block=2, budget=8.0)
        for batch in (1, 16):
            k = 4
            logits = torch.randn(batch, k + 1, vocab, generator=gen, device=self.device).to(self.dtype)
            draft = logits[:, :k].argmax(-1).cpu()  # [B, K]: greedy drafts, all accepted
            lens = torch.full((batch,), k)
            rows = {}
            generators: dict[str, torch.Generator] = {}

            def pick(seq_id: str, spec: SamplingSpec):
                if spec.seed is None:
                    return None
                return generators.setdefault(seq_id, torch.Generator(device=self.device).manual_seed(spec.seed))

            sampled = SamplingSpec(temperature=0.8, top_p=0.95, seed=1)
            for kind, spec in (("greedy", SamplingSpec()), ("sampled", sampled)):
                batch_in = TargetBatch([f"s{b}" for b in range(batch)], [-1] * batch, [[0] * (k + 1)] * batch,
                                       draft, lens, [spec] * batch)
                reps = 3 if self.smoke else 20
                for i in range(2 + reps):
                    if i == 2:
                        self.sync()
                        start = time.perf_counter()
                    result = score_round(logits, batch_in, pick)
                rows[f"{kind}_round_ms"] = round((time.perf_counter() - start) / reps * 1e3, 3)
            start = time.perf_counter()
            for _ in range(reps):
                verify_asd_scores(draft, result.scores, [config.new_ledger() for _ in range(batch)], config, lens)
            rows["asd_host_ms"] = round((time.perf_counter() - start) / reps * 1e3, 3)
            out[f"b{batch}_k{k}"] = rows
        return out


def goals(sections: dict) -> dict:
    def get(*path):
        node = sections
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    use, v4 = get("decode", "b1", "bandwidth_use"), get("verify_cost", "b1", "v", 4)
    host, step = get("decode", "b1", "host_ms_per_step"), get("decode", "b1", "step_ms")
    identity = get("greedy_identity", "float32")
    return {
        "decode_b1_bandwidth_use>=0.60": None if use is None else use >= GOALS["decode_b1_bandwidth_use"],
        "v4_b1<=1.15": None if v4 is None else v4 <= GOALS["v4_b1"],
        "greedy_identity_fp32_alpha_1": None if identity is None else identity["identical"] and identity["alpha"] == 1,
        "host_runs_ahead_of_device_b1": None if host is None or step is None else host < step,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    parser.add_argument("--budget-s", type=float, default=420.0, help="optional sections are skipped past 3/4 of it")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.smoke:
        torch.set_num_threads(1)
    check = Check(args.smoke, args.budget_s, Path(args.out))
    if check.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in the identity check
    check.run("copy_bandwidth", check.copy_bandwidth)
    check.run("attention", check.attention)
    check.run("decode", check.decode)
    check.run("verify_cost", check.verify_cost)
    check.run("greedy_identity", check.greedy_identity)
    check.run("verifiers", check.verifiers)
    check.run("decode_variants", check.decode_variants, optional=True)
    report = check.report()
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report["goals"]), f"-> {args.out} in {report['elapsed_s']} s", flush=True)
    errors = [name for name, s in check.sections.items() if "error" in s]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
