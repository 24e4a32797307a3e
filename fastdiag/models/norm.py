"""The layer norm of the zoo's models and of their vectorised ensembles (`fastdiag.models.ensemble`).

PyTorch's fused layer norm takes one ``[C]`` weight, so an ensemble, whose members each have their own,
normalises without the affine step and applies it as one ``addcmul``. A single model computing its
layer norm the same way gets the same bits as its packed member: the forward's multiply-add is fused in
both, and the gradients of weight and bias are sums over the same rows in the same order (the fused
kernel's backward sums them in its own order, which differs in the last bits and, over hundreds of
steps of chaotic training, by whole evaluations).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Layer norm over the last axis; ``weight`` and ``bias`` broadcast against ``x`` (``[C]``, or
    ``[K, 1, …, C]`` for K members)."""
    return torch.addcmul(bias, F.layer_norm(x, x.shape[-1:], eps=eps), weight)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters, initialisation and state dict) computed by `layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
