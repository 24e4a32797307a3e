"""A small Mamba (selective state-space) model for the grokking task (SPEC §4).

``n_layers`` residual blocks ``x + mixer(LayerNorm(x))`` over token + no position embeddings
(the SSM is causal and position aware by itself), a final LayerNorm and a linear read-out.
Output: logits ``[B, vocab]`` for the last position (``all_positions=True``: ``[B, T, vocab]``).

The mixer is mamba-ssm's ``Mamba`` block (fused CUDA kernels) when ``import mamba_ssm`` works and
the model is built for a CUDA device; otherwise ``SelectiveSSM`` below, a pure-PyTorch selective
scan with the same parameter names and shapes as ``mamba_ssm.modules.mamba_simple.Mamba``
(``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``), so a state
dict moves between the two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MambaConfig:
    vocab_size: int = 98
    seq_len: int = 3
    n_layers: int = 4
    d_model: int = 128
    expand: int = 4
    d_state: int = 16
    d_conv: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "expand", "d_state", "d_conv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"mamba: {name} must be a positive integer, got {value!r}")


def mamba_ssm_available() -> bool:
    """True when mamba-ssm and its CUDA extension import (never on a CPU-only machine)."""
    try:
        import mamba_ssm  # noqa: F401
        from mamba_ssm.modules.mamba_simple import Mamba  # noqa: F401
    except Exception:  # ImportError, or the extension failing to load (selective_scan_cuda)
        return False
    return True


def selective_scan(u, delta, A, B, C, D, z=None, delta_bias=None, delta_softplus=True):
    """Reference selective scan (mamba-ssm's ``selective_scan_ref`` semantics), in u's dtype.

    u, delta, z: ``[b, d, l]``; A: ``[d, n]``; B, C: ``[b, n, l]``; D, delta_bias: ``[d]``.
    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t,   y_t = C_t · h_t + D u_t,   y *= silu(z).
    """
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    delta_u = delta * u
    h = None
    ys = []
    # Sequences here are short (T = 3): a loop over time is the clearest scan. Each step touches
    # [b, d, n] tensors only (slicing the [b, d, l] inputs is cheap, also in the backward pass).
    for t in range(u.shape[2]):
        dBu = delta_u[:, :, t, None] * B[:, None, :, t]               # [b, d, n]
        if h is None:
            h = dBu
        else:
            h = torch.exp(delta[:, :, t, None] * A) * h + dBu          # exp(Δ_t A) h + Δ_t B_t u_t
        ys.append(torch.bmm(h, C[:, :, t, None]).squeeze(-1))          # C_t · h_t, [b, d]
    y = torch.stack(ys, dim=-1) + u * D[:, None]
    return y * F.silu(z) if z is not None else y


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv1d(x)[..., :L]`` of the mixer's depthwise ``Conv1d`` (padding d_conv − 1), written out:
    out[:, c, t] = bias[c] + Σ_k weight[c, 0, k] · x[:, c, t − (d_conv − 1) + k]. Same numbers, but
    several times faster than CPU ``conv1d``'s backward pass on these short sequences."""
    width = weight.shape[-1]
    windows = F.pad(x, (width - 1, 0)).unfold(-1, width, 1)           # [b, d, l, width]
    out = (windows * weight[:, None, 0, :]).sum(-1)
    return out + bias[:, None] if bias is not None else out


class SelectiveSSM(nn.Module):
    """Pure-PyTorch Mamba mixer; parameters identical to mamba_ssm's ``Mamba`` (same init)."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4) -> None:
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=True)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        # mamba-ssm's initialisation: dt_proj weight ~ U(±dt_rank^-0.5), softplus(dt bias) in
        # [dt_min, dt_max] log-uniformly, A = -[1..d_state] per channel (S4D real), D = 1.
        nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))   # inverse softplus
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))                          # [d_inner, d_state]
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)    # [b, d_inner, l] each
        x = F.silu(causal_depthwise_conv(x, self.conv1d.weight, self.conv1d.bias))
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = (dt @ self.dt_proj.weight.t()).transpose(1, 2)                       # bias added in the scan
        A = -torch.exp(self.A_log.float())
        y = selective_scan(x, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z=z,
                           delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        return self.out_proj(y.transpose(1, 2))


class MambaBlock(nn.Module):
    def __init__(self, cfg: MambaConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class MambaLM(nn.Module):
    def __init__(self, cfg: MambaConfig, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.config = cfg
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self.uses_mamba_ssm = on_cuda and mamba_ssm_available()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(MambaBlock(cfg, self._mixer(cfg, i, device)) for i in range(cfg.n_layers))
        self.norm_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def _mixer(self, cfg: MambaConfig, layer_idx: int, device) -> nn.Module:
        if self.uses_mamba_ssm:
            from mamba_ssm.modules.mamba_simple import Mamba

            return Mamba(d_model=cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand,
                         layer_idx=layer_idx, device=device)
        return SelectiveSSM(cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand)

    def forward(self, idx: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        x = self.norm_f(x)
        return self.head(x) if all_positions else self.head(x[:, -1])
