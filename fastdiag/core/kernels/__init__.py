"""Kernels behind `fastdiag.head_stats`.

- `head_stats_ref`: pure PyTorch, the float64 ground truth and the "obvious" eager baseline.
- `head_stats_torch`: the chunked single-pass PyTorch path (CPU default).
- `head_stats_triton` (imported lazily, it needs triton): the fused kernel and its torch.library op.
- `device`: the GPU table, the device limits a launcher sizes its tiles by and the spill probe. The
  compile report (`fastdiag bench --kernel-report`) lives in `fastdiag.kernel_report` and imports
  the kernels, never the reverse.
"""
from .head_stats_ref import head_stats_ref
from .head_stats_torch import head_stats_torch

__all__ = ["head_stats_ref", "head_stats_torch"]
