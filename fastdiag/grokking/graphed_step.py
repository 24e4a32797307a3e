"""Training steps bound by the device: one whole step replayed as a CUDA graph.

A canonical run is a 0.82 M-parameter model at batch 512 and T = 3: on a GPU its eager step is a few
hundred tiny kernels, each launched from Python, so the step costs what the host takes to launch them.
`GraphedSteps` captures the step's body once — forward, backward, the optimizer step, the loss
accumulation and, on a measured step, the head statistics — and replays it with one launch.

How it stays the same training as the eager loop:
- Each distinct step shape is its own graph: (the minibatch's shape, measured or not). The first
  ``WARMUP_STEPS`` steps of each shape run eagerly (real steps, on a side stream as CUDA graphs
  require: lazy initialisation such as the optimizer's state happens there); the next one captures
  the shape's graph (capturing runs nothing) and every later one replays it. A step's minibatch
  indices are copied into the graph's own index buffer; nothing is read back to the host.
- The optimizer must be capturable: its step counter and bias corrections live on the device
  (`make_adamw`: `torch.optim.AdamW(capturable=True, foreach=True)`; the ensemble's own AdamW has the
  same capturable form). That is the only numerical difference from the eager CUDA loop: PyTorch's
  capturable AdamW computes the bias corrections in float32 on the device instead of in float64 on
  the host (relative differences ~1e-7 per step; the device tests compare the traces at 1e-4).
- The head statistics of a measured step are computed inside its graph; the graph adds them into
  accumulators of its own, which `merged_stats` adds to the monitor's at each evaluation (the
  monitor's hooks do not run on a replay: its step counter is advanced here instead).
- A shape whose capture fails (an op that cannot be captured) runs eagerly from then on, with a
  one-line warning: slower, never different.

CPU runs never use it (`graphed_device`): the CPU trainer is unchanged.
"""
from __future__ import annotations

import copy
import warnings
from collections import Counter
from typing import Callable

import torch

from fastdiag.core.stats import HeadStats

# Eager steps of each step shape before its graph is captured (CUDA graphs need at least one, on a
# side stream, so that lazy initialisation happens outside the capture; PyTorch's examples use 3).
WARMUP_STEPS = 2


def graphed_device(graphed: bool, device: torch.device) -> bool:
    """Whether a run with ``graphed`` on ``device`` trains through CUDA graphs: on CUDA only."""
    return bool(graphed) and torch.device(device).type == "cuda"


def make_adamw(params, lr: float, weight_decay: float, graphed: bool) -> torch.optim.AdamW:
    """The runs' AdamW (betas 0.9/0.98): PyTorch's defaults, or capturable and foreach for graphs."""
    extra = {"capturable": True, "foreach": True} if graphed else {}
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay, **extra)


def make_capturable(opt: torch.optim.Optimizer) -> None:
    """``load_state_dict`` takes the saved groups' flags: put the graphs' back (a checkpoint of an eager
    run resumed graphed)."""
    for group in opt.param_groups:
        group["capturable"], group["foreach"] = True, True


class GraphedSteps:
    """``steps(idx)`` runs one training step on the minibatch indices ``idx`` (a device tensor):
    ``body(idx)`` eagerly for the first steps of each shape, then as a replayed CUDA graph.

    ``body(idx)`` is the step: forward (measured by the monitor when due), backward, optimizer step,
    loss accumulation, all into tensors that persist between steps. ``monitor()`` returns the monitor
    measuring the model (or None); its step counter is the trainer's step.
    """

    def __init__(self, body: Callable[[torch.Tensor], None], monitor: Callable[[], object],
                 device: torch.device) -> None:
        self.body, self.monitor, self.device = body, monitor, device
        self.reset()

    def reset(self) -> None:
        """Forget every graph: the tensors they captured were replaced (a restored optimizer state,
        members dropped from an ensemble). Only right after an evaluation: nothing measured is pending."""
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._eager_steps: Counter = Counter()
        self._failed: set = set()
        self._side = None                         # the stream of the eager (warm-up) steps
        self._acc: dict[str, HeadStats] = {}      # added into by the measured graphs
        self._carry: dict[str, HeadStats] = {}    # taken from the monitor before a capture

    def __deepcopy__(self, memo):
        """A copy (`Trainer.branch`, right after an evaluation) captures its own graphs, of the copied
        body and monitor."""
        twin = GraphedSteps.__new__(GraphedSteps)
        twin.body, twin.monitor, twin.device = (copy.deepcopy(x, memo) for x in (self.body, self.monitor, self.device))
        twin.reset()
        return twin

    @property
    def captured(self) -> list[tuple]:
        """The step shapes replayed as graphs: (index shape, measured)."""
        return list(self._graphs)

    def __call__(self, idx: torch.Tensor) -> None:
        monitor = self.monitor()
        measured = monitor is not None and monitor.step % monitor.every == 0
        key = (tuple(idx.shape), measured)
        entry = self._graphs.get(key)
        if entry is not None:
            graph, buffer = entry
            buffer.copy_(idx)
            graph.replay()
            if monitor is not None:
                monitor.set_step(monitor.step + 1)
            return
        self._eager(idx)
        self._eager_steps[key] += 1
        if self._eager_steps[key] >= WARMUP_STEPS and key not in self._failed:
            self._capture(key, idx, monitor)

    def _eager(self, idx: torch.Tensor) -> None:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.body(idx)
        torch.cuda.current_stream(self.device).wait_stream(side)

    def _capture(self, key: tuple, idx: torch.Tensor, monitor) -> None:
        measured = key[1]
        buffer = idx.clone()
        step = monitor.step if monitor is not None else None
        if measured:
            if not self._acc:          # the shapes of the statistics, from the eager measured steps
                self._acc = {name: _zeros_like(s) for name, s in (monitor.latest_stats() or {}).items()}
            # what the monitor summed so far is kept aside: the capture's own record is dropped below
            self._carry = _add(self._carry, monitor.merged_stats(reset=True))
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        try:
            with torch.cuda.graph(graph):
                self.body(buffer)
                if measured:
                    for name, stats in (monitor.latest_stats() or {}).items():
                        _add_into(self._acc[name], stats)
        except Exception as exc:   # noqa: BLE001 - a capture that fails costs speed, never the run
            self._failed.add(key)
            warnings.warn(f"graphed steps: the step of shape {key[0]}{' (measured)' if measured else ''} could not "
                          f"be captured as a CUDA graph ({type(exc).__name__}: {exc}); it runs eagerly",
                          RuntimeWarning, stacklevel=3)
            torch.cuda.synchronize(self.device)
            graph = None
        finally:
            if monitor is not None:
                if measured:
                    monitor.merged_stats(reset=True)    # the capture pass: not a step
                monitor.set_step(step)
        if graph is not None:
            self._graphs[key] = (graph, buffer)

    def merged_stats(self, monitor_stats: dict[str, HeadStats]) -> dict[str, HeadStats]:
        """The head statistics since the last evaluation: the monitor's ``monitor_stats`` (its
        ``merged_stats(reset=True)``) plus what the graphs measured; starts the next sum."""
        out = _add(_add(dict(monitor_stats), self._carry), _cloned(self._acc))
        self._carry = {}
        for stats in self._acc.values():
            for t in (stats.gram, stats.entropy_sum, stats.rows, stats.invalid):
                t.zero_()
        return out


def _fields(s: HeadStats) -> tuple[torch.Tensor, ...]:
    return s.gram, s.entropy_sum, s.rows, s.invalid


def _zeros_like(s: HeadStats) -> HeadStats:
    return HeadStats(*(torch.zeros_like(t) for t in _fields(s)))


def _cloned(stats: dict[str, HeadStats]) -> dict[str, HeadStats]:
    return {name: HeadStats(*(t.clone() for t in _fields(s))) for name, s in stats.items()}


def _add_into(acc: HeadStats, s: HeadStats) -> None:
    for a, t in zip(_fields(acc), _fields(s)):
        a.add_(t)


def _add(a: dict[str, HeadStats], b: dict[str, HeadStats]) -> dict[str, HeadStats]:
    out = dict(a)
    for name, s in b.items():
        out[name] = s if name not in out else out[name] + s
    return out
