"""The ops that make a CUDA host wait for the device, and a dispatch mode that finds them on any device.

A measured training step must never read a device value on the host: each such read stalls the CPU
until the GPU has drained its queue, which is what keeps a small model's step host-bound. On CPU
nothing waits, so these ops would go unnoticed: `SyncDetector` names them wherever they run (every
backend, CPU tests), and the device tests add ``torch.cuda.set_sync_debug_mode("error")`` on a GPU.

    with SyncDetector() as seen:
        step()
    assert not seen.ops, seen.ops
"""
from __future__ import annotations

import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# Ops whose output size or value the host must read before it can go on (on CUDA: a device sync).
HOST_SYNC_OPS = frozenset({
    _aten._local_scalar_dense.default,     # .item(), float(t), bool(t), int(t)
    _aten.is_nonzero.default,              # if t:
    _aten.equal.default,                   # torch.equal
    _aten.allclose.default,
    _aten.nonzero.default,                 # nonzero, argwhere, where(cond) with one argument
    _aten.argwhere.default,
    _aten.masked_select.default,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.bincount.default,
})


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def syncs(func, args, kwargs) -> bool:
    """Whether an aten call makes the host wait for the device."""
    if func in HOST_SYNC_OPS:
        return True
    packet = getattr(func, "overloadpacket", None)
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        return _bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))  # a boolean index: nonzero
    if packet is _aten.repeat_interleave:
        repeats = args[0] if func is _aten.repeat_interleave.Tensor else (args[1] if len(args) > 1 else None)
        # a tensor of repeats: the output's size is their sum, read on the host unless output_size says it
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if packet in (_aten._to_copy, _aten.copy_):
        source = args[1] if packet is _aten.copy_ else args[0]
        target = args[0].device if packet is _aten.copy_ else kwargs.get("device")
        return isinstance(source, torch.Tensor) and source.is_cuda and target is not None \
            and torch.device(target).type == "cpu" and not kwargs.get("non_blocking", False)
    return False


class SyncDetector(TorchDispatchMode):
    """Records every aten call that would make a CUDA host wait (``ops``: op names in call order;
    ``where``: the innermost fastdiag source line that issued each, or ""); ``raise_on_sync=True``
    raises RuntimeError at the first one instead."""

    def __init__(self, raise_on_sync: bool = False):
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.ops: list[str] = []
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncs(func, args, kwargs):
            self.ops.append(str(func))
            self.where.append(_fastdiag_line())
            if self.raise_on_sync:
                raise RuntimeError(f"host sync: {func}")
        return func(*args, **kwargs)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fastdiag_line() -> str:
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_PACKAGE) and not frame.filename.endswith("host_sync.py"):
            return f"{os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))}:{frame.lineno}"
    return ""
