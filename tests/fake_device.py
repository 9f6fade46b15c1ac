"""A pretend accelerator on the CPU: tensors tagged as living on `cuda:0`, with CUDA's device rules enforced.

`FakeDevice` is a `TorchFunctionMode`. Inside it a tensor is "on the device" when it is an `OnDevice` (its
data stays on the host); `.device` says `cuda:0` for those, and factories called with a cuda device make
them. CUDA's rules are then checked on every torch call, so a CPU test fails exactly where a GPU run would:

- an op combining a device tensor with a host tensor of rank ≥ 1 raises "Expected all tensors to be on the
  same device" (host scalars of rank 0 are allowed, as on CUDA; host index tensors are refused, stricter
  than CUDA, which copies them silently);
- a generator must live where the numbers are drawn (`torch.Generator(device="cuda")` makes a device one);
- `.numpy()` of a device tensor raises, as on CUDA.

It also counts **host syncs**: every read of a device tensor's values by the host (`.item()`, `.tolist()`,
`bool()`, `int()`, `.cpu()`, `.to("cpu")`), so a test can assert "one sync per round".

Use `with fake_device() as device:` (it also swaps in the generator class) and `on_device(tensor)` /
`module_on_device(module)` to place inputs and models.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cuda", 0)
CPU = torch.device("cpu")
_REAL_GENERATOR = torch.Generator
_GETTERS = {"device": lambda tagged: FAKE if tagged else CPU, "is_cuda": lambda tagged: tagged,
            "is_cpu": lambda tagged: not tagged}
_SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__"}


class OnDevice(torch.Tensor):
    """A host tensor that `FakeDevice` treats as living on cuda:0."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class FakeGenerator(_REAL_GENERATOR):
    """torch.Generator with a device: `FakeGenerator(device="cuda")` draws for device tensors only."""

    def __new__(cls, device="cpu"):
        generator = super().__new__(cls)  # a host generator; the device is only a tag
        generator.on_device = torch.device(device).type == "cuda"
        return generator

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self) -> torch.device:
        return FAKE if self.on_device else CPU


def on_device(tensor: torch.Tensor) -> OnDevice:
    return tensor.as_subclass(OnDevice)


def _tagged(x) -> bool:
    return isinstance(x, OnDevice)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.Tensor):
        return _tagged(device)
    return device is not None and torch.device(device).type == "cuda"


def _tag(out):
    return tree_map(lambda t: on_device(t) if isinstance(t, torch.Tensor) and not _tagged(t) else t, out)


def _untag(out):
    return tree_map(lambda t: t.as_subclass(torch.Tensor) if _tagged(t) else t, out)


class FakeDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func.__self__, "__name__", "") in _GETTERS:
            return _GETTERS[func.__self__.__name__](_tagged(args[0]))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tagged = any(map(_tagged, tensors))
        if name in _SYNCS:
            self.syncs += _tagged(args[0])
            return func(*args, **kwargs)
        if name in ("numpy", "__array__") and tagged:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")
        if name == "pin_memory":  # no page locking without CUDA: a copy stands in for it
            return _untag(args[0]).clone()
        if name in ("cpu", "cuda", "to"):
            return self._move(func, name, args, kwargs)
        target = kwargs.get("device")
        if target is not None:  # a factory: made on the host, tagged when asked for the device
            kwargs["device"] = CPU
            self._check_generator(kwargs, _is_cuda(target))
            out = func(*args, **kwargs)
            return _tag(out) if _is_cuda(target) else out
        if tagged and any(not _tagged(t) and t.dim() > 0 for t in tensors):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({name})")
        self._check_generator(kwargs, tagged)
        out = func(*args, **kwargs)
        return _tag(out) if tagged else out

    def _move(self, func, name, args, kwargs):
        source = args[0]
        if name == "cpu":
            target = CPU
        elif name == "cuda":
            target = FAKE
        else:
            target = kwargs.pop("device", None)
            rest = []
            for a in args[1:]:
                if isinstance(a, (str, torch.device)) or (isinstance(a, torch.Tensor) and target is None):
                    target = a
                else:
                    rest.append(a)
            args = (source, *rest)
            kwargs.pop("non_blocking", None)
            if isinstance(target, torch.Tensor):
                target, args = (FAKE if _tagged(target) else CPU), (source, target.dtype, *rest)
        if target is None:  # a dtype change: stays where it is
            out = func(*args, **kwargs)
            return _tag(out) if _tagged(source) else out
        plain = source.as_subclass(torch.Tensor) if _tagged(source) else source
        if name == "to":
            out = torch.Tensor.to(plain, *args[1:], **kwargs)
        else:
            out = plain.clone()
        if _is_cuda(target):
            return _tag(out if out is not plain else plain.view_as(plain))
        self.syncs += _tagged(source)
        return out.clone() if out is plain else out

    @staticmethod
    def _check_generator(kwargs, on_the_device: bool) -> None:
        generator = kwargs.get("generator")
        if generator is None:
            return
        if getattr(generator, "on_device", False) != on_the_device:
            want, got = ("cuda", "cpu") if on_the_device else ("cpu", "cuda")
            raise RuntimeError(f"Expected a '{want}' device type for generator but found '{got}'")


@contextlib.contextmanager
def fake_device():
    """`with fake_device() as mode:` device rules on; `mode.syncs` counts host reads of device tensors."""
    mode = FakeDevice()
    torch.Generator = FakeGenerator
    try:
        with mode:
            yield mode
    finally:
        torch.Generator = _REAL_GENERATOR


def module_on_device(module: torch.nn.Module) -> torch.nn.Module:
    """Tag every parameter and buffer of `module` as on the device (shared parameters stay shared)."""
    tagged: dict[int, OnDevice] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            t = tagged.setdefault(id(p), on_device(p.detach()))
            del sub._parameters[name]
            setattr(sub, name, t)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = tagged.setdefault(id(b), on_device(b))
    return module
