"""K models of one architecture as one vectorised model: every weight gets a leading member axis.

``EnsembleTransformer(models)`` stacks K `Transformer`s (each built with its own seed,
so member k starts exactly where the single run with that seed starts) and runs them in one forward
pass: batched matmuls over the member axis, one SDPA call per layer, and — on diagnostic steps — one
``head_stats`` call per layer on probabilities ``[K, B, H, T, T]``. ``EnsembleMLP`` does the same for
the MLP, ``EnsembleMamba`` for the pure-PyTorch Mamba (one `selective_scan_members` call per layer).
``member_state_dict(k)`` gives member k back as a single model's state dict, and ``keep(index)`` drops
finished members so they stop costing time.

The LSTM (cuDNN/oneDNN's fused recurrent kernel takes one weight set) and a Mamba built on mamba-ssm's
CUDA kernels (one model per kernel call) are not vectorised: `vectorisable(arch)` says so for the
LSTM, `stack_models` refuses mamba-ssm mixers, and the sweep runs them one by one.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mamba import MambaLM, causal_depthwise_conv, selective_scan_members
from .mlp import MLP
from .norm import layer_norm
from .transformer import Transformer, _head_stats

VECTORISED = ("transformer", "mlp", "mamba")


def vectorisable(arch: str) -> bool:
    return arch in VECTORISED


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-member ``F.linear``: x ``[K, ..., in]``, weight ``[K, out, in]``, bias ``[K, out]``."""
    k, shape = x.shape[0], x.shape[1:-1]
    flat = x.reshape(k, -1, x.shape[-1])
    y = torch.bmm(flat, weight.transpose(1, 2)) if bias is None else torch.baddbmm(bias[:, None], flat, weight.transpose(1, 2))
    return y.reshape(k, *shape, weight.shape[1])


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return layer_norm(x, weight.view(view), bias.view(view), eps)


class _Stacked(nn.Module):
    """Parameters of K copies of ``template`` stacked on a leading axis, under the same names."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        if not models:
            raise ValueError("models: expected at least one member model")
        self.names = [name for name, _ in models[0].named_parameters()]
        for m in models[1:]:
            if [n for n, _ in m.named_parameters()] != self.names:
                raise ValueError("models: members must share one architecture and size")
        self.flat = nn.ParameterList(
            nn.Parameter(torch.stack([dict(m.named_parameters())[n].detach() for m in models]).clone())
            for n in self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.flat[self.names.index(name)]

    @property
    def members(self) -> int:
        return self.flat[0].shape[0]

    def member_state_dict(self, k: int) -> dict[str, torch.Tensor]:
        return {n: p[k].detach().clone() for n, p in zip(self.names, self.flat)}

    @torch.no_grad()
    def keep(self, index: torch.Tensor) -> None:
        """Keep only the members ``index``. New Parameter objects: autograd caches a leaf's shape."""
        self.flat = nn.ParameterList(nn.Parameter(p.index_select(0, index)) for p in self.flat)


class EnsembleTransformer(_Stacked):
    # measures itself like the zoo's attention (`fastdiag.attach` sets ``record``), all its layers at
    # once: ``stats`` maps each layer's name to its HeadStats, the members leading
    records_head_stats = True

    def __init__(self, models: list[Transformer]) -> None:
        super().__init__(models)
        cfg = models[0].config
        if cfg.tie_embeddings:
            raise ValueError("models: tied embeddings are not vectorised")
        self.config = cfg
        self.record = False           # on: compute probabilities explicitly and keep HeadStats
        self.diag_backend = "auto"
        self.stats: dict[str, object] = {}

    def _attention(self, x: torch.Tensor, i: int, last_only: bool = False) -> torch.Tensor:
        """`CausalSelfAttention.forward` with a member axis: x ``[K, b, t, c]``."""
        p = f"blocks.{i}.attn."
        k, b, t, c = x.shape
        h = self.config.n_heads
        qkv = _linear(x, self[p + "qkv.weight"], self[p + "qkv.bias"])
        q, kk, v = (z.view(k, b, t, h, c // h).transpose(2, 3) for z in qkv.split(c, dim=-1))
        if self.record:
            scores = (q @ kk.transpose(-2, -1)) * (1.0 / math.sqrt(kk.size(-1)))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)     # [K, B, H, T, T]
            self.stats[f"blocks.{i}.attn"] = _head_stats(probs.detach(), self.diag_backend)
            y = (probs[..., -1:, :] if last_only else probs) @ v
        else:
            # members folded into the batch: SDPA's fused CPU kernel takes 4-D inputs (5-D falls back
            # to the unfused maths, whose bits differ from the single model's)
            y = F.scaled_dot_product_attention(q.flatten(0, 1), kk.flatten(0, 1), v.flatten(0, 1),
                                               is_causal=True).view(q.shape)
            if last_only:
                y = y[..., -1:, :]
        return _linear(y.transpose(2, 3).reshape(k, b, y.shape[3], c), self[p + "proj.weight"], self[p + "proj.bias"])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx ``[K, B, T]`` -> logits of the last position ``[K, B, vocab]``."""
        k, b, t = idx.shape
        members = torch.arange(k, device=idx.device)[:, None, None]
        x = self["tok_emb.weight"][members, idx] + self["pos_emb.weight"][:, None, :t]
        last = self.config.n_layers - 1
        for i in range(self.config.n_layers):
            p = f"blocks.{i}."
            attended = self._attention(_layer_norm(x, self[p + "ln1.weight"], self[p + "ln1.bias"]), i, i == last)
            # the last block: the last position alone past its attention, as `Block.forward(last_only=True)`
            x = x[:, :, -1] + attended[:, :, 0] if i == last else x + attended
            hid = _layer_norm(x, self[p + "ln2.weight"], self[p + "ln2.bias"])
            hid = F.gelu(_linear(hid, self[p + "mlp.fc.weight"], self[p + "mlp.fc.bias"]))
            x = x + _linear(hid, self[p + "mlp.proj.weight"], self[p + "mlp.proj.bias"])
        x = _layer_norm(x, self["ln_f.weight"], self["ln_f.bias"])
        return _linear(x, self["head.weight"], None)


class EnsembleMLP(_Stacked):
    def __init__(self, models: list[MLP]) -> None:
        super().__init__(models)
        self.config = models[0].config
        self.record = False
        self.stats: dict[str, object] = {}
        self.linears = [n[: -len(".weight")] for n in self.names if n.endswith(".weight") and n != "tok_emb.weight"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        k, b, t = idx.shape
        members = torch.arange(k, device=idx.device)[:, None, None]
        x = self["tok_emb.weight"][members, idx].reshape(k, b, -1)
        for j, name in enumerate(self.linears):
            x = _linear(x, self[name + ".weight"], self[name + ".bias"])
            if j < len(self.linears) - 1:
                x = F.relu(x)
        return x


class EnsembleMamba(_Stacked):
    """K `MambaLM`s with the PyTorch mixer (`SelectiveSSM`): member k computes what model k computes."""

    def __init__(self, models: list[MambaLM]) -> None:
        if any(m.uses_mamba_ssm for m in models):
            raise ValueError("models: Mambas on mamba-ssm's CUDA kernels are not vectorised (the kernels take "
                             "one model per call); train them one by one")
        super().__init__(models)
        self.config = models[0].config
        mixer = models[0].layers[0].mixer
        self.split = [mixer.dt_rank, mixer.d_state, mixer.d_state]
        self.record = False            # no attention: nothing to record
        self.stats: dict[str, object] = {}

    def _mixer(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """`SelectiveSSM.forward` with a member axis: x ``[K, b, l, d_model]``."""
        p = f"layers.{i}.mixer."
        x, z = _linear(x, self[p + "in_proj.weight"], None).chunk(2, dim=-1)
        x = F.silu(causal_depthwise_conv(x, self[p + "conv1d.weight"], self[p + "conv1d.bias"]))
        dt, B, C = _linear(x, self[p + "x_proj.weight"], None).split(self.split, dim=-1)
        dt = _linear(dt, self[p + "dt_proj.weight"], None)
        A = -torch.exp(self[p + "A_log"].float())
        y = selective_scan_members(x, dt, A, B, C, self[p + "D"].float(), z=z,
                                   delta_bias=self[p + "dt_proj.bias"].float(), delta_softplus=True)
        return _linear(y, self[p + "out_proj.weight"], None)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx ``[K, B, T]`` -> logits of the last position ``[K, B, vocab]``."""
        members = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
        x = self["tok_emb.weight"][members, idx]
        for i in range(self.config.n_layers):
            p = f"layers.{i}.norm."
            x = x + self._mixer(_layer_norm(x, self[p + "weight"], self[p + "bias"]), i)
        x = _layer_norm(x[:, :, -1], self["norm_f.weight"], self["norm_f.bias"])
        return _linear(x, self["head.weight"], None)


def stack_models(arch: str, models: list[nn.Module]) -> _Stacked:
    if arch == "transformer":
        return EnsembleTransformer(models)
    if arch == "mlp":
        return EnsembleMLP(models)
    if arch == "mamba":
        return EnsembleMamba(models)
    raise ValueError(f"arch: {arch!r} is not vectorised (only {', '.join(VECTORISED)}); run its members one by one")
