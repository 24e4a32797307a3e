"""`HeadStats`: the sufficient statistics of one attention layer's heads, and what derives from them.

A layer's diagnostics (definitions: README.md, "The diagnostics") are functions of three sums over valid query rows:
``gram[i, j] = <v_i, v_j>`` (head patterns flattened over batch, rows and keys), ``entropy_sum[h]``
(sum of row entropies of head h) and ``rows`` (how many valid rows). Sums add, so statistics of two
batches, micro-batches, steps or GPUs merge exactly with ``+``; s̄ and σ_H are read out afterwards.
A fourth sum, ``invalid``, is > 0 when probability entries outside [0, 1] or non-finite were seen
(the reference counts them; the fast backends count chunks or programs that saw one): any such
entry makes every derived value NaN, detected on the device without a host sync.

``entropy_sum`` is float64 from every backend: near-uniform attention makes the head entropies
≈ log Tk apart by ~1e-5 of that, and σ_H is their spread (see `fastdiag.core.kernels.head_stats_ref`).

Everything here is a device tensor with the problem dimensions ``[...]`` leading (layers, ensemble
members); nothing syncs with the host until the caller converts a result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class HeadStats:
    gram: torch.Tensor         # [..., H, H]
    entropy_sum: torch.Tensor  # [..., H] float64 from head_stats (float32 accepted)
    rows: torch.Tensor         # [...]
    invalid: torch.Tensor      # [...] > 0 when entries outside [0, 1] or non-finite were seen

    def __post_init__(self) -> None:
        lead = self.rows.shape
        h = self.entropy_sum.shape[-1] if self.entropy_sum.dim() else 0
        if (self.gram.shape != (*lead, h, h) or self.entropy_sum.shape != (*lead, h)
                or self.invalid.shape != lead):
            raise ValueError(
                "HeadStats: inconsistent shapes gram %s, entropy_sum %s, rows %s, invalid %s"
                % (tuple(self.gram.shape), tuple(self.entropy_sum.shape), tuple(self.rows.shape),
                   tuple(self.invalid.shape)))

    @property
    def num_heads(self) -> int:
        return self.entropy_sum.shape[-1]

    def __add__(self, other: "HeadStats") -> "HeadStats":
        if not isinstance(other, HeadStats):
            return NotImplemented
        if other.gram.shape != self.gram.shape:
            raise ValueError(f"HeadStats +: shapes differ, gram {tuple(self.gram.shape)} vs {tuple(other.gram.shape)}")
        return HeadStats(self.gram + other.gram, self.entropy_sum + other.entropy_sum,
                         self.rows + other.rows, self.invalid + other.invalid)

    def __getitem__(self, index) -> "HeadStats":
        """Select problems along the leading dimensions (e.g. one layer of a stacked call)."""
        if self.rows.dim() == 0:
            raise IndexError("HeadStats has no leading problem dimension to index")
        return HeadStats(self.gram[index], self.entropy_sum[index], self.rows[index], self.invalid[index])

    def to(self, *args, **kwargs) -> "HeadStats":
        return HeadStats(*(t.to(*args, **kwargs) for t in self._tensors()))

    def detach(self) -> "HeadStats":
        return HeadStats(*(t.detach() for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.gram, self.entropy_sum, self.rows, self.invalid

    def all_reduce(self, group=None) -> "HeadStats":
        """Sum over the ranks of a ``torch.distributed`` group: one flat all-reduce, no host sync."""
        import torch.distributed as dist

        parts = self._tensors()
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        out, offset = [], 0
        for t in parts:
            out.append(flat[offset:offset + t.numel()].view(t.shape).to(t.dtype))
            offset += t.numel()
        return HeadStats(*out)

    # ---- read-out: derived in float64, NaN where the statistics are not usable ----------------

    def valid(self) -> torch.Tensor:
        """Bool ``[...]``: no bad probability entry, at least one valid row, and every head's pattern
        nonzero (an all-zero or underflowed head has no direction: its cosines, s and C are NaN)."""
        nonzero = (torch.diagonal(self.gram, dim1=-2, dim2=-1) > 0).all(-1)
        return (self.invalid == 0) & (self.rows > 0) & nonzero

    def _nan_unless_valid(self, value: torch.Tensor) -> torch.Tensor:
        ok = self.valid().reshape(*self.rows.shape, *([1] * (value.dim() - self.rows.dim())))
        return torch.where(ok, value, torch.full_like(value, float("nan")))

    def cosine(self) -> torch.Tensor:
        """``C[i, j] = G[i, j] / sqrt(G[i, i] G[j, j])``, ``[..., H, H]``."""
        g = self.gram.to(torch.float64)
        norm = torch.diagonal(g, dim1=-2, dim2=-1).clamp_min(0).sqrt()
        return self._nan_unless_valid(g / (norm[..., :, None] * norm[..., None, :]))

    def sync(self) -> torch.Tensor:
        """Head synchronisation s_l: mean off-diagonal cosine. NaN for a single head."""
        c = self.cosine()
        h = self.num_heads
        if h < 2:
            return torch.full(self.rows.shape, float("nan"), dtype=torch.float64, device=c.device)
        off_diagonal = c.sum((-2, -1)) - torch.diagonal(c, dim1=-2, dim2=-1).sum(-1)
        return off_diagonal / (h * (h - 1))

    def head_entropy(self) -> torch.Tensor:
        """E_h: mean row entropy of each head over valid rows (nats), ``[..., H]``."""
        e = self.entropy_sum.to(torch.float64) / self.rows.to(torch.float64)[..., None]
        return self._nan_unless_valid(e)

    def entropy_spread(self) -> torch.Tensor:
        """σ_l: population std (ddof 0) of the head entropies."""
        return self.head_entropy().std(dim=-1, correction=0)

    def participation_ratio(self) -> torch.Tensor:
        """(Σλ)² / (H Σλ²) over the eigenvalues λ of C, in [1/H, 1]; tr C = H and Σλ² = ‖C‖²_F."""
        c = self.cosine()
        h = self.num_heads
        return h / (c * c).sum((-2, -1))

    def spectral_gap(self) -> torch.Tensor:
        """λ1 − λ2 of C (C is positive semi-definite). NaN for a single head or invalid stats.

        Uses ``torch.linalg.eigvalsh``, whose CUDA path may check its solver status on the host: call
        it at read-out time, not inside a step that must stay free of host syncs (the other
        read-outs never sync)."""
        c = self.cosine()
        if self.num_heads < 2:
            return torch.full(self.rows.shape, float("nan"), dtype=torch.float64, device=c.device)
        finite = torch.isfinite(c).all(-1).all(-1)
        eye = torch.eye(self.num_heads, dtype=c.dtype, device=c.device)
        # eigvalsh would fail on NaN input; substitute the identity and put the NaN back after.
        safe = torch.where(finite[..., None, None], c, eye)
        eig = torch.linalg.eigvalsh(safe)  # ascending
        gap = eig[..., -1] - eig[..., -2]
        return torch.where(finite, gap, torch.full_like(gap, float("nan")))

    def summary(self) -> dict[str, torch.Tensor]:
        return {"sync": self.sync(), "spread": self.entropy_spread()}


@dataclass(frozen=True)
class Summary:
    """Model-level s̄(t) = mean_l s_l and σ_H(t) = mean_l σ_l (unweighted), with per-layer values."""

    s_bar: torch.Tensor
    sigma_h: torch.Tensor
    per_layer: dict[str, dict[str, torch.Tensor]]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Device values keyed ``s_bar``, ``sigma_h``, ``sync/<layer>``, ``spread/<layer>``."""
        out = {"s_bar": self.s_bar, "sigma_h": self.sigma_h}
        for name, values in self.per_layer.items():
            out[f"sync/{name}"] = values["sync"]
            out[f"spread/{name}"] = values["spread"]
        return out

    def to_floats(self) -> dict:
        """`tensors` as host values (this syncs)."""
        return {k: (t.item() if t.numel() == 1 else t.tolist()) for k, t in self.tensors().items()}


def summarize(stats_per_layer: Mapping[str, HeadStats] | Sequence[HeadStats]) -> Summary:
    """Average the layers' s_l and σ_l without weights (the paper's definition)."""
    if isinstance(stats_per_layer, Mapping):
        items = list(stats_per_layer.items())
    else:
        items = [(str(i), s) for i, s in enumerate(stats_per_layer)]
    if not items:
        raise ValueError("stats_per_layer: expected at least one layer's HeadStats, got none")
    for name, s in items:
        if not isinstance(s, HeadStats):
            raise TypeError(f"stats_per_layer[{name!r}]: expected HeadStats, got {type(s).__name__}")
    shapes = {name: tuple(s.rows.shape) for name, s in items}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"stats_per_layer: layers have different leading shapes {shapes}; expected one "
                         "shape (the same members/problems in every layer)")
    per_layer = {name: s.summary() for name, s in items}
    s_bar = torch.stack([v["sync"] for v in per_layer.values()]).mean(0)
    sigma_h = torch.stack([v["spread"] for v in per_layer.values()]).mean(0)
    return Summary(s_bar=s_bar, sigma_h=sigma_h, per_layer=per_layer)
