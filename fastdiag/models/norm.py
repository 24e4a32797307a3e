"""The layer norm of the zoo's models and of their vectorised ensembles (`fastdiag.models.ensemble`).

PyTorch's fused layer norm takes one ``[C]`` weight, so an ensemble, whose members each have their own,
normalises without the affine step and applies it as one ``addcmul``. A single model computing its
layer norm the same way gets the same bits as its packed member: the forward's multiply-add is fused in
both, and the gradients of weight and bias are sums over the same rows in the same order (the fused
kernel's backward sums them in its own order, which differs in the last bits and, over hundreds of
steps of chaotic training, by whole evaluations).

On CPU the normalisation itself runs through the affine kernel with a weight of ones and a bias of
zeros: PyTorch's CPU kernel without weight takes a slower path (250 against 145 µs at [512, 3, 128],
one thread), and x·1 + 0 is x, so forward and backward give the same bits (checked for float32,
float64 and bfloat16, one and two threads, in tests/test_models.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Layer norm over the last axis; ``weight`` and ``bias`` broadcast against ``x`` (``[C]``, or
    ``[K, 1, …, C]`` for K members)."""
    return torch.addcmul(bias, _normalised(x, eps), weight)


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.layer_norm`` without an affine step (the same bits, see above)."""
    if not x.is_cpu:
        return F.layer_norm(x, x.shape[-1:], eps=eps)
    ones = torch.ones(x.shape[-1], dtype=x.dtype)
    return F.layer_norm(x, x.shape[-1:], ones, torch.zeros_like(ones), eps)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters, initialisation and state dict) computed by `layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
