"""The `fastdiag` command line: the only layer that knows flags and prints.

``app`` holds the click group, the error handling (one line on stderr, exit status 2) and the
mapping from library parameter names to flags; each command lives in its own module, registered here
by name and loaded when it is used (``fastdiag --help`` then needs no torch); tests/test_cli_run.py
imports every one, so a command module that fails to import fails a test instead of vanishing.
"""
import os

from fastdiag.cli.threads import wait_policy_env

# OpenMP reads its wait policy once, when torch loads it, so it is set before anything below can load
# torch: a bounded spin, fast on a quiet machine without burning a busy one's cores (cli/threads.py).
# A user's own OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME stands.
os.environ.update(wait_policy_env())

from fastdiag.cli.app import CLIError, cli, main  # noqa: E402 - after the policy

cli.lazy = {
    "run": ("fastdiag.cli.run", "Train one run of a ∘ b mod p and write result.json, trace.csv and trajectory.png."),
    "sweep": ("fastdiag.cli.sweep", "Run a grid of training runs (λ × seeds × architectures/sizes) into a result store."),
    "merge": ("fastdiag.cli.stores", "Merge shard stores IN... into OUT (created if missing)."),
    "export": ("fastdiag.cli.stores", "Export a store's runs table (config and result flattened into columns)"),
    "analyze": ("fastdiag.cli.analyze", "Critical weight decay λ_c, exponent ν (with bootstrap CIs), regime table"),
    "plot": ("fastdiag.cli.plot", "Draw the sweep figures of STORE as PNG and SVG into DIR"),
    "bench": ("fastdiag.cli.bench", "Measure fastdiag's overhead against a pure-PyTorch reference"),
    "intervene": ("fastdiag.cli.intervene", "Causal interventions at the Phase-2 peak"),
    "headdim": ("fastdiag.cli.intervene", "Per-head dimension: train every (d, H, seed) at fixed λ"),
    "paper": ("fastdiag.cli.paper", "The paper reproduction: the README's table from data/paper/, its runs, figure"),
}

__all__ = ["CLIError", "cli", "main"]
