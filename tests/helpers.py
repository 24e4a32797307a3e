"""What several test modules share, in one place (fixtures live in tests/conftest.py, helpers shared with
the benchmarks in fastdiag/testing.py): float64 references and models for the attach tests, and the
command-line and store helpers of the hostile-input tests. Test modules import from here, never from
each other."""
import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdiag
from fastdiag.cli import main
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import EnsembleAdamW
from fastdiag.store import Store
from fastdiag.testing import NanoGPT, rel_err

TOL = 1e-5        # fp32 against float64 (README, "The diagnostics")


# ---- attach: float64 references and small models ------------------------------------------------

def assert_stats_close(got, want, tol=TOL):
    """HeadStats against a float64 reference: sums, rows, and the derived s_l and σ_l."""
    assert torch.equal(got.rows.double(), want.rows.double())
    assert got.invalid.item() == 0
    assert rel_err(got.gram, want.gram) <= tol
    assert rel_err(got.entropy_sum, want.entropy_sum) <= tol
    if got.num_heads > 1:
        assert abs(got.sync().item() - want.sync().item()) <= tol * abs(want.sync().item())
    scale = max(1.0, want.head_entropy().abs().max().item())
    assert abs(got.entropy_spread().item() - want.entropy_spread().item()) <= tol * scale


def assert_named(monitor, warned, name, why):
    """Module ``name`` is listed in ``coverage()["missing"]`` with ``why`` in its reason, and a warning
    names it with the same words."""
    assert why in monitor.coverage()["missing"][name], monitor.coverage()["missing"]
    assert any(f"{name!r}" in w and why in w for w in warned), warned


def eager_probs(q, k, attn_mask=None, is_causal=False, scale=None):
    """Eager attention probabilities [B, H, Tq, Tk] in float64 and the rows that see some key."""
    h, hk = q.shape[-3], k.shape[-3]
    q, k = q.double(), k.double().repeat_interleave(h // hk, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    tq, tk = scores.shape[-2:]
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if is_causal:
        visible = visible.tril()
    if attn_mask is not None:
        visible = visible & (attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf"))
        if attn_mask.dtype != torch.bool:
            scores = scores + attn_mask.double()
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(-1)
    visible = visible.expand(scores.shape)
    rows = visible.any(-1).all(-2)  # [B, Tq]: sees a key in every head
    if tq == tk and attn_mask is not None:  # self-attention: a key nobody may see is padding, so is its row
        rows = rows & visible.any(-2).any(-2)
    return torch.nan_to_num(probs, nan=0.0), rows


def reference_stats(q, k, **kw):
    probs, rows = eager_probs(q, k, **kw)
    return fastdiag.head_stats(probs, rows, backend="reference")


class SDPALayer(nn.Module):
    def __init__(self, d=16, heads=4, kv_heads=4, **sdpa_kwargs):
        super().__init__()
        self.heads, self.kv_heads, self.sdpa_kwargs = heads, kv_heads, sdpa_kwargs
        self.hd = d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd)
        self.out = nn.Linear(d, d)
        self.last = None

    def forward(self, x, attn_mask=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.last = (q.detach(), k.detach())
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **self.sdpa_kwargs)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class TwoLayers(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.layers = nn.ModuleList([SDPALayer(**kw), SDPALayer(**kw)])

    def forward(self, x, attn_mask=None):
        for layer in self.layers:
            x = x + layer(x, attn_mask)
        return x


def tiny_hf(family: str, attn: str):
    """A 2-layer HF GPT-2 or grouped-query Llama (4 heads, d 32, vocab 64) in training mode, no dropout."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=32, intermediate_size=64, vocab_size=64)
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = attn
    return model.train()


def nano(seed=0, **kw):
    torch.manual_seed(seed)
    return NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8, **kw)


class StandInZooAttention(nn.Module):
    """The zoo protocol: `record` makes the module compute P explicitly and keep head_stats(P)."""
    records_head_stats = True

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(d, 3 * d)
        self.record, self.stats, self.diag_backend = False, None, "auto"
        self.probs = None

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(c, -1))
        if self.record:
            probs = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
            self.stats = fastdiag.head_stats(probs.detach(), backend=self.diag_backend)
            self.probs = probs.detach()
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return y.transpose(1, 2).reshape(b, t, c)


# ---- the command line and result stores (hostile inputs) ----------------------------------------

def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fastdiag.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def one_line_error(r, needle, code=2):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, r.stderr
    assert len(lines) == 1 and lines[0].startswith("fastdiag: error:") and needle in lines[0], r.stderr


def cli_in_process(capsys, *args):
    """``fastdiag ARGS`` in this process: (exit status, stdout, stderr)."""
    try:
        main([*map(str, args)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(code, err, needle):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fastdiag: error:") and needle in lines[0], err


@contextlib.contextmanager
def tmpfs(path, size):
    """A real file system of ``size`` bytes at ``path`` (ENOSPC when full; remountable read-only)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip("needs a tmpfs mount (root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path):
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def small_store(path, n=3):
    """A store with ``n`` done runs (tiny fake results and traces)."""
    cfgs = [RunConfig(weight_decay=0.1 * (i + 1), seed=i, epochs=5, p=11) for i in range(n)]
    with Store(path) as st:
        st.add_runs(cfgs)
        for c in cfgs:
            st.record_done(c.run_id(), {"regime": "grok", "t_grok_epoch": 3, "n_params": 10},
                           [{"epoch": e, "step": e, "test_acc": 0.5, "train_acc": 1.0, "s_bar": 0.9,
                             "sigma_h": 0.1} for e in range(1, 6)])
    return cfgs


def insert_arms(store, experiment: str, arms=("control", "reinit"), arm_id: str = "{experiment}-s0-{arm}",
                trace_rows: int = 0, **columns) -> None:
    """Intervention arms of seed 0 of ``experiment``, written as raw rows (``columns``: the stored
    text of config, settings, intervention, result or metrics, '{}' unless given, damaged if a
    test says so), each with ``trace_rows`` trace rows."""
    from fastdiag.store.interventions import ensure_tables

    values = {"config": "{}", "settings": "{}", "intervention": "{}", "result": "{}", "metrics": "{}", **columns}
    ensure_tables(store)
    with store.transaction() as conn:
        for arm in arms:
            aid = arm_id.format(experiment=experiment, arm=arm)
            conn.execute("INSERT INTO intervention_runs (arm_id, experiment, seed, arm, branch_of, branch_epoch, "
                         "config, settings, intervention, result, metrics, created_at) "
                         "VALUES (?, ?, 0, ?, 'r', 10, ?, ?, ?, ?, ?, 0)",
                         (aid, experiment, arm, *(values[k] for k in
                                                  ("config", "settings", "intervention", "result", "metrics"))))
            conn.executemany("INSERT INTO intervention_trace (arm_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, '{}')",
                             [(aid, i, i, i) for i in range(trace_rows)])


def assert_ensemble_adamw_is_torchs_per_member(device: str = "cpu", capturable: bool = False):
    """EnsembleAdamW over three stacked members, each with its own weight decay, against
    torch.optim.AdamW on each member alone (``capturable``: both in the form a CUDA graph replays)."""
    torch.manual_seed(0)
    singles = [torch.randn(5, 4, device=device, requires_grad=True) for _ in range(3)]
    stacked = torch.stack([p.detach() for p in singles]).requires_grad_()
    decays = [0.0, 0.3, 2.0]
    graphed = dict(capturable=True, foreach=True) if capturable else {}
    opts = [torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.98), weight_decay=wd, **graphed)
            for p, wd in zip(singles, decays)]
    ens = EnsembleAdamW([stacked], lr=1e-2, weight_decay=decays, **({"capturable": True} if capturable else {}))
    for _ in range(5):
        grads = torch.randn(3, 5, 4, device=device)
        for p, o, g in zip(singles, opts, grads):
            p.grad = g.clone()
            o.step()
        stacked.grad = grads.clone()
        ens.step()
    for k, p in enumerate(singles):
        torch.testing.assert_close(stacked[k].detach(), p.detach(), rtol=1e-6, atol=1e-7)


# ---- documentation: printed commands -----------------------------------------------------------

def assert_cli_line_parses(line: str):
    """The options of one printed ``fastdiag ...`` command parse (names, types, choices, required ones),
    subcommand groups such as ``fastdiag paper regenerate`` included: nothing runs."""
    import shlex

    import click

    from fastdiag.cli import cli

    args = shlex.split(line)[1:]
    ctx = click.Context(cli, info_name="fastdiag")
    command = cli.get_command(ctx, args[0])
    assert command is not None, line
    sub = command.make_context(args[0], args[1:], parent=ctx)
    if isinstance(command, click.Group):
        sub_command = command.get_command(sub, args[1])
        assert sub_command is not None, line
        sub_command.make_context(args[1], args[2:], parent=sub)
