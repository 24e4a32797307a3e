"""How `fastdiag`'s OpenMP threads wait between parallel regions: set before torch loads (torch-free).

OpenMP reads its wait policy once, when torch loads it. torch's runtime on Linux is libgomp, whose
default spins 300,000 rounds before a waiting thread sleeps (7.7 ms here: a round is one pause
instruction, 26 ns on these AMD EPYC cores). That is fast on a quiet machine and crawls on a busy one:
threads spinning at every op's barrier burn the cores a descheduled teammate needs (80 s/epoch against
10.6 s passive at load 15). ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) rescued the busy case but
costs a third of an epoch on a quiet machine (1.69 against 1.25 s/epoch, issue 41: every op wakes its
teammate through the kernel). A bounded spin keeps most of both: 1,000 rounds (26 µs, libgomp's own
count for an oversubscribed machine) covers the gap between two ops of a training step, then sleeps;
at load 13-15 it cost 1.15-1.17x of passive, where 10,000 rounds cost 1.9x and the default 7.6x
(benchmarks/RESULTS.md, "fastdiag run against the bare loop").

The Intel and LLVM runtimes (libiomp, libomp: conda's MKL builds, macOS wheels) read KMP_BLOCKTIME in
milliseconds, too coarse for this: they keep the passive wait (0), as measured safe before.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

SPIN_COUNT = 1000
POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_policy_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``environ`` (default ``os.environ``) for the bounded spin; none when the
    user has chosen a policy (any of `POLICY_VARIABLES` set)."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name, "").strip() for name in POLICY_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT), "KMP_BLOCKTIME": "0"}
