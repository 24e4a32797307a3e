"""`fastdiag run` against the bare PyTorch loop, per epoch, start-up included, side by side.

The bare loop is the obvious PyTorch loop of the same run: the same model (the canonical pre-LN
transformer, 4 x 8 x 128, written out below with plain torch modules), the same data (a ∘ b mod 97,
a seeded 50 % split), AdamW (1e-3, betas 0.9/0.98, λ 1), minibatch 512 reshuffled every epoch, and the
same evaluation every epoch (train and test loss and accuracy in chunks of 512 rows, printed).
It has no diagnostics and writes nothing. `fastdiag run` is the command line with its defaults
(threads, wait policy) plus the flags that fix the horizon (``--epochs N --no-stop-at-grok --quiet
--checkpoint-every off``); it also measures the heads every 10 steps and writes result.json,
trace.csv and trajectory.png.

Each measurement is a fresh process timed from its start to its exit (Python, the imports, the
model, the run, the outputs), divided by the epochs. The two alternate round by round (ABBA), first on
the machine as it is ("quiet") and then beside two CPU hogs (``yes > /dev/null``, started and
stopped here); each line carries the 1-minute load average at its start.

    python benchmarks/run_vs_bare_loop.py                      # 12 epochs, 3 rounds, quiet then hogs
    python benchmarks/run_vs_bare_loop.py --rounds 5 --loads quiet
    python benchmarks/run_vs_bare_loop.py --env OMP_WAIT_POLICY=PASSIVE   # fastdiag run under another policy
    python benchmarks/run_vs_bare_loop.py --bare 12            # only the bare loop, printing its epochs

The summary gives per load the median seconds per epoch of each and the ratio of the medians, with
the range of the per-round ratios (each round's fastdiag run over the bare loop beside it).
Targets (issue 41): <= 1.05x quiet, <= 1.2x beside two hogs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SEED, P, WEIGHT_DECAY, BATCH, CHUNK = 42, 97, 1.0, 512, 512


def bare_loop(epochs: int) -> None:
    """The bare loop (runs in its own process: ``--bare N``)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, d_ff: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class Model(nn.Module):
        def __init__(self, vocab: int, d: int = 128, heads: int = 8, d_ff: int = 512, layers: int = 4) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(3, d)
            self.blocks = nn.Sequential(*(Block(d, heads, d_ff) for _ in range(layers)))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.blocks(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
            return self.head(self.ln(x[:, -1]))

    torch.manual_seed(SEED)
    a, b = torch.cartesian_prod(torch.arange(P), torch.arange(P)).T
    x = torch.stack([a, b, torch.full_like(a, P)], 1)
    y = (a + b) % P
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SEED))
    train, test = perm[:len(y) // 2], perm[len(y) // 2:]
    model = Model(P + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=WEIGHT_DECAY)
    shuffle = torch.Generator().manual_seed(SEED)

    @torch.no_grad()
    def evaluate(rows):
        loss = correct = 0.0
        for start in range(0, len(rows), CHUNK):
            logits = model(x[rows[start:start + CHUNK]])
            target = y[rows[start:start + CHUNK]]
            loss += F.cross_entropy(logits, target, reduction="sum")
            correct += (logits.argmax(-1) == target).sum()
        return (loss / len(rows)).item(), (correct / len(rows)).item()

    for epoch in range(1, epochs + 1):
        model.train()
        order = train[torch.randperm(len(train), generator=shuffle)]
        for start in range(0, len(order), BATCH):
            idx = order[start:start + BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
        (train_loss, train_acc), (test_loss, test_acc) = evaluate(train), evaluate(test)
        print(f"epoch {epoch}  train {train_loss:.4f} {train_acc:.3f}  test {test_loss:.4f} {test_acc:.3f}",
              flush=True)


def fastdiag_command(epochs: int, out: str) -> list[str]:
    exe = shutil.which("fastdiag") or os.path.join(os.path.dirname(sys.executable), "fastdiag")
    return [exe, "run", "--epochs", str(epochs), "--no-stop-at-grok", "--quiet", "--checkpoint-every", "off",
            "--out", out]


def timed(command: list[str], env: dict | None = None) -> float:
    """Seconds from the start of ``command``'s process to its exit."""
    t0 = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


@contextlib.contextmanager
def hogs(n: int):
    """``n`` processes of ``yes > /dev/null`` for the duration."""
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        time.sleep(1.0)                 # let the scheduler see them
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()


def side_by_side(epochs: int, rounds: int, label: str, fastdiag_env: dict, bare_env: dict) -> dict:
    runs = {"fastdiag run": [], "bare loop": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        commands = {"fastdiag run": fastdiag_command(epochs, os.path.join(tmp, "run")),
                    "bare loop": [sys.executable, os.path.abspath(__file__), "--bare", str(epochs)]}
        for r in range(rounds):
            pair = {}
            for name in (list(commands) if r % 2 == 0 else list(commands)[::-1]):
                load = os.getloadavg()[0]
                pair[name] = timed(commands[name], fastdiag_env if name == "fastdiag run" else bare_env) / epochs
                runs[name].append(pair[name])
                print(f"{label:>5}  round {r}  {name:<12} {pair[name]:6.3f} s/epoch  (load {load:5.2f})", flush=True)
            ratios.append(pair["fastdiag run"] / pair["bare loop"])
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {"label": label, "median": med, "ratio": med["fastdiag run"] / med["bare loop"],
            "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of processes per load")
    parser.add_argument("--loads", default="quiet,hogs", help="quiet, hogs (two `yes` beside), or both")
    parser.add_argument("--env", action="append", default=[], metavar="VAR=VALUE",
                        help="set in fastdiag run's environment (e.g. another OpenMP wait policy); repeatable")
    parser.add_argument("--bare-env", action="append", default=[], metavar="VAR=VALUE",
                        help="set in the bare loop's environment (e.g. fastdiag's own wait policy, "
                             "GOMP_SPINCOUNT=1000, to compare the rest alone); repeatable")
    parser.add_argument("--bare", type=int, metavar="EPOCHS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        return bare_loop(args.bare)
    fastdiag_env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
    bare_env = dict(os.environ, **dict(item.split("=", 1) for item in args.bare_env))
    print(f"# {args.epochs} epochs per process, {args.rounds} rounds per load, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}"
          + (f"; fastdiag run with {' '.join(args.env)}" if args.env else "")
          + (f"; the bare loop with {' '.join(args.bare_env)}" if args.bare_env else ""), flush=True)
    results = []
    for label in args.loads.split(","):
        if label not in ("quiet", "hogs"):
            parser.error(f"--loads: expected quiet and/or hogs, got {label!r}")
        with hogs(2) if label == "hogs" else contextlib.nullcontext():
            results.append(side_by_side(args.epochs, args.rounds, label, fastdiag_env, bare_env))
    print("# summary (seconds per epoch, process start to exit; ratio = fastdiag run / bare loop; 'quiet' = no "
          "hogs added: the machine as it was, see each line's load)")
    for res in results:
        med = res["median"]
        target = 1.05 if res["label"] == "quiet" else 1.2
        print(f"{res['label']:>5}: fastdiag run {med['fastdiag run']:.3f}  bare loop {med['bare loop']:.3f}  "
              f"ratio {res['ratio']:.2f}x  (rounds {min(res['ratios']):.2f}-{max(res['ratios']):.2f}x; "
              f"target <= {target}x)")
    print(f"# load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
