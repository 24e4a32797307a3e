"""Kernels behind `fastdiag.head_stats`.

- `head_stats_ref`: pure PyTorch, the float64 ground truth and the "obvious" eager baseline.
- `head_stats_torch`: the chunked single-pass PyTorch path (CPU default).
- `head_stats_triton` (imported lazily, it needs triton): the fused kernel and its torch.library op.
- `report`: every Triton kernel compiled for sm_90 and read with the CUDA tools, no GPU needed
  (`fastdiag bench --kernel-report`).
"""
from .head_stats_ref import head_stats_ref
from .head_stats_torch import head_stats_torch

__all__ = ["head_stats_ref", "head_stats_torch"]
