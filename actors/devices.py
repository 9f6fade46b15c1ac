"""Moving a round's small tensors between the host and an engine's device: one copy each way.

Everything that crosses the contracts (`actors.contracts`: draft batches, target batches and results) lives on
the host, because it crosses processes and the coordinator, scheduler and policy are host code. An engine on
a GPU moves what it needs there once per call (`to_device`: a round's tensors packed into one host-to-device
copy per dtype, pinned so the host does not wait) and brings its results back once (`to_host`: one device-to-host copy,
the round's one host sync). On the CPU both are free.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(tensors: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
    """Host tensors on `device`, shapes and dtypes kept: one copy per dtype, from pinned memory, so the host
    does not wait for the device (a plain `.to("cuda")` from pageable memory synchronises the stream)."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    out: list[Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in members])  # [N]
        if device.type == "cuda":
            flat = flat.pin_memory()  # the caching host allocator keeps it alive until the copy is done
        moved = flat.to(device, non_blocking=True)
        start = 0
        for i in members:
            out[i] = moved[start : start + tensors[i].numel()].view(tensors[i].shape)
            start += tensors[i].numel()
    return out


def to_host(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Device tensors on the host in one copy (one host sync), with their dtypes: long and bool exactly
    (through float64, exact below 2^53), floats as float32 (bfloat16 and float16 widen exactly)."""
    if all(t.device.type == "cpu" for t in tensors):
        return [_host_dtype(t) for t in tensors]
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).cpu()  # [N]: the one sync
    out, start = [], 0
    for t in tensors:
        out.append(_host_dtype(flat[start : start + t.numel()].view(t.shape), t.dtype))
        start += t.numel()
    return out


def _host_dtype(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    dtype = dtype or t.dtype
    if dtype.is_floating_point:
        return t if t.dtype == torch.float32 else t.float()
    return t if t.dtype == dtype else t.to(dtype)


class DeviceTimer:
    """Time of work queued on a device, read after the caller's own sync (no extra one).

    On a GPU, `time.perf_counter()` around a forward measures only the launches; CUDA events bracket the
    device's work and `seconds()` reads them once the results have reached the host. On the CPU (where the
    work is done when the call returns) it is the wall clock."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self._events = device.type == "cuda" and torch.cuda.is_available()
        self._start = self._stop = None

    def start(self) -> DeviceTimer:
        if self._events:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def stop(self) -> None:
        if self._events:
            self._stop = torch.cuda.Event(enable_timing=True)
            self._stop.record()
        else:
            self._stop = time.perf_counter()

    def seconds(self) -> float:
        if self._events:
            self._stop.synchronize()  # already done after the caller's sync: returns at once
            return self._start.elapsed_time(self._stop) / 1000.0
        return self._stop - self._start
