"""Kernels behind `fastdiag.head_stats`.

- `head_stats_ref`: pure PyTorch, the float64 ground truth and the "obvious" eager baseline.
- `head_stats_torch`: the vectorised PyTorch path (CPU default).
- `head_stats_triton` (imported lazily, it needs triton): the fused kernel and its torch.library op.
"""
from .head_stats_ref import head_stats_ref, head_stats_torch

__all__ = ["head_stats_ref", "head_stats_torch"]
