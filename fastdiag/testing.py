"""What tests and benchmarks share: random causal attention probabilities with padded query rows, the
exactness targets and the error measure they are checked with, 16-bit Q/K rows whose products cancel and
a sharp row's float64 entropy, a free local port for multi-process tests, and a trainer that kills its
worker (for the sweep backends' lost-worker tests)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import torch

# The exactness targets (README, "The diagnostics"): relative error against float64 on the same
# rounded inputs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """Largest absolute difference relative to the largest magnitude of ``want`` (in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for torch.distributed's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dying_trainer(cfg, marker_dir: str):
    """A sweep's ``train_fn`` whose seed-1 runs kill their worker process (a lost worker): at λ = 0.1
    only on the first attempt (a marker file in ``marker_dir`` remembers it), at λ = 1 on every
    attempt. Other runs return at once, as a finished run would look to the store."""
    marker = Path(marker_dir) / f"{cfg.run_id()}.seen"
    if cfg.seed == 1 and (cfg.weight_decay == 1.0 or not marker.exists()):
        marker.write_text("x")
        os._exit(9)
    return SimpleNamespace(config=cfg, result={"regime": "grok", "t_grok_epoch": 10.0, "n_params": 1},
                           trace=[{"epoch": 1, "step": 1, "test_acc": 1.0}])


def in_inf_padding(x: torch.Tensor) -> torch.Tensor:
    """x as a strided view inside a larger buffer full of +inf (last two dimensions padded): an
    out-of-bounds read turns into inf/NaN and fails the comparison."""
    buf = torch.full((*x.shape[:-2], x.shape[-2] + 3, x.shape[-1] + 5), float("inf"), dtype=x.dtype)
    buf[..., 1:-2, 2:-3] = x
    return buf[..., 1:-2, 2:-3]


def random_probs(shape, dtype=torch.float32, causal=True, seed=0, device="cpu", garbage_rows=None):
    """Post-softmax probabilities ``[..., H, Tq, Tk]`` with heads of distinct sharpness.

    Each head's logits get their own temperature so head entropies differ (as in trained models),
    and ``causal`` masks keys after the query (aligned at the end when Tq != Tk).
    ``garbage_rows`` (bool ``[..., B, Tq]``) rows are overwritten with NaN / out-of-range values,
    which must be ignored when those rows are masked out.
    """
    g = torch.Generator().manual_seed(seed)
    *lead, h, tq, tk = shape
    logits = torch.randn(*shape, generator=g, dtype=torch.float64)
    temperature = torch.linspace(0.3, 3.0, h, dtype=torch.float64).view(h, 1, 1)
    logits = logits * temperature
    if causal:
        q = torch.arange(tq).view(tq, 1) + (tk - tq)
        k = torch.arange(tk).view(1, tk)
        logits = logits.masked_fill(k > q, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key (Tq > Tk)
    if garbage_rows is not None:
        bad = garbage_rows.unsqueeze(-2).unsqueeze(-1).expand_as(probs)
        junk = torch.full_like(probs, float("nan"))
        junk[..., ::2] = 7.0
        probs = torch.where(bad, junk, probs)
    return probs.to(dtype).to(device)


def random_query_mask(shape, seed=0, keep=0.7, device="cpu"):
    """Bool ``shape`` (``[..., B, Tq]``) with at least one valid row per problem."""
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(shape, generator=g) < keep
    flat = mask.reshape(-1, shape[-2] * shape[-1]) if len(shape) >= 2 else mask.reshape(1, -1)
    flat[:, 0] = True
    return flat.reshape(shape).to(device)


class NanoGPT(torch.nn.Module):
    """A nanoGPT-style causal LM that calls ``F.scaled_dot_product_attention`` (for tests and benchmarks)."""

    def __init__(self, vocab: int = 64, d_model: int = 64, n_heads: int = 4, n_layers: int = 2, seq_len: int = 32):
        super().__init__()
        self.n_heads = n_heads
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(seq_len, d_model)
        self.blocks = torch.nn.ModuleList(_NanoBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class _NanoBlock(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


# What a reader of the attach snippets (README, docs/attach.md) has before the snippet: a tiny model, its
# optimiser, and a loader whose loop runs a training step per batch. Both snippet tests run it first.
ATTACH_SNIPPET_PREAMBLE = """
import os, tempfile
import torch
import fastdiag
from torch.utils.tensorboard import SummaryWriter
os.chdir(tempfile.mkdtemp())
torch.manual_seed(0)
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

class Loader:
    '''The reader's loop body is "..." in the snippet: this loader runs a training step per batch.'''
    def __iter__(self):
        for _ in range(12):
            optimizer.zero_grad()
            model(torch.randn(2, 5, 16)).pow(2).mean().backward()
            optimizer.step()
            yield None

loader = Loader()
"""


def snippet_key(block: str, preambles: dict) -> str:
    """The key of ``preambles`` a documentation code block starts with (StopIteration: a snippet with
    no preamble yet)."""
    first = block.lstrip().splitlines()[0]
    return next(k for k in preambles if first.startswith(k))


def run_snippet(block: str, preambles: dict, checks: dict, directory: Path) -> subprocess.CompletedProcess:
    """A documentation code block run as a reader would paste it: its preamble first, then the block,
    then what it promises (``checks``), as one script in a fresh interpreter."""
    key = snippet_key(block, preambles)
    script = Path(directory) / "snippet.py"
    script.write_text(textwrap.dedent(preambles[key]) + "\n" + block + "\n" + textwrap.dedent(checks.get(key, "")),
                      encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def cancelling_qk(seed, size=300.0, gap=6.0, b=2, h=4, t=16, d=64, tops=4, dtype=torch.float16):
    """(q, k, scale) with sharp rows whose runners-up's products cancel exactly. Head-dimension columns, in
    a random order: t "small" ones, where each row's q and each key's k make its score, and pairs of "big"
    ones, where every q holds (w, w) and a runner-up key (β, −β) with |w|, |β| ~ size: their products cancel
    to exactly 0, so Σ_d |q_d k_d| ~ (d − t)·size² while |s| ~ gap. Key j < tops is row i's top when
    j = i mod tops (+gap nats, −gap for the other rows) and has no big part (its score, the LSE and the
    row's mass are exact: the mass check cannot see the error); the other keys are runners-up at N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    scale = d ** -0.5
    pairs = (d - t) // 2
    q_small = torch.randn(b, h, t, t, **f64).to(dtype).double()
    want = torch.randn(b, h, t, t, **f64)                                   # scores [rows, keys], nats
    want[..., :tops] = torch.where(torch.arange(t)[:, None] % tops == torch.arange(tops), gap, -gap)
    k_small = torch.linalg.solve(q_small, want / scale).transpose(-1, -2)  # [keys, t]
    w = (size * torch.randn(b, h, 1, pairs, **f64)).to(dtype).double().expand(b, h, t, pairs)
    beta = (size * torch.randn(b, h, t, pairs, **f64)).to(dtype).double()
    beta[..., :tops, :] = 0.0
    order = torch.randperm(d, generator=g)
    q = torch.cat([q_small, w, w], -1)[..., order]
    k = torch.cat([k_small, beta, -beta], -1)[..., order]
    return q.to(dtype), k.to(dtype), scale


def row_entropy(s: torch.Tensor) -> torch.Tensor:
    """float64 entropy of each row of scores (nats), shifted by the row's maximum (keeps a sharp row's digits)."""
    x = s - s.amax(-1, keepdim=True)
    e = torch.exp(x)
    top = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, x.argmax(-1, keepdim=True), True)
    rest = torch.where(top, 0.0, e).sum(-1)
    return torch.log1p(rest) + (e * -x).sum(-1) / (1 + rest)
