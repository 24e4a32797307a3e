"""`fastdiag.attach(model)`: head diagnostics inside an existing training loop, model unchanged.

    monitor = fastdiag.attach(model, every=10)   # before or after torch.compile / DDP wrapping
    ...train as usual...
    monitor.latest()     # {"step": 40, "mode": "train", "s_bar": ..., "sigma_h": ..., "sync/<layer>": ...}
    monitor.detach()     # hooks and patches removed, the model is as it was

Steps are the model's training-mode forward passes. On every `every`-th one (steps 0, every,
2·every, ...) each attention layer's `HeadStats` is computed on the device from that same forward
pass (see `fastdiag.adapters` for how each kind of attention is found and measured) and kept there;
the host sees the values only when they are read (`latest`, `history`) or a logger is flushed.

torch.compile: `torch.compile(model)` and `model.compile()` call the root module's hooks outside
the traced frame. The root's begin/end hooks are `torch.compiler.disable`d, so the step counter
lives in plain Python; everything inside the forward (submodule hooks, the SDPA wrapper) reads a
single Python bool, "is this pass measured", so a compiled model has two graphs, measured and not.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch

from fastdiag import adapters
from fastdiag.adapters import CHUNK_BYTES
from fastdiag.diagnostics import BACKENDS
from fastdiag.stats import HeadStats, Summary, summarize

__all__ = ["Monitor", "attach"]

_MONITORS: dict[int, "Monitor"] = {}
_IDS = itertools.count()
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, Monitor]" = weakref.WeakKeyDictionary()


def _eager(fn):
    """Never traced by torch.compile (a pass's begin and end: they read and write the step counter)."""
    return torch.compiler.disable(fn, recursive=True)


def _unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)`` returns a wrapper; hook the module inside it (same names, same hooks)."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                    torch.nn.Module):
        model = model._orig_mod
    return model


@dataclass
class _Record:
    step: int
    mode: str                      # "train" or "eval"
    keys: list[str]                # "s_bar", "sigma_h", "sync/<layer>", "spread/<layer>"
    values: torch.Tensor | None    # float64 [len(keys)] on the device until converted
    host: dict | None = None
    logged: bool = field(default=False)


def _logger_from(log):
    if log is None:
        return None
    if hasattr(log, "add_scalar"):  # torch.utils.tensorboard.SummaryWriter and look-alikes
        def to_writer(step, values):
            for tag, value in values.items():
                log.add_scalar(tag, value, step)
        return to_writer
    if callable(log):
        return log
    raise TypeError(f"log: expected a SummaryWriter (add_scalar) or a callable (step, dict), "
                    f"got {type(log).__name__}")


class Monitor:
    """Measures an attached model's attention heads; see `attach` for the arguments."""

    def __init__(self, model: torch.nn.Module, every: int = 10, layers=None, backend: str = "auto",
                 log=None, measure_eval: bool = False, all_reduce: bool = False, group=None,
                 flush_every: int = 10, steps: str = "forward", chunk_bytes: int = CHUNK_BYTES):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected a positive integer, got {every!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every: expected a positive integer, got {flush_every!r}")
        if steps not in ("forward", "manual"):
            raise ValueError(f"steps: expected 'forward' or 'manual', got {steps!r}")
        model = _unwrap_compiled(model)
        if model in _ATTACHED:
            raise ValueError("model: already attached; detach the other monitor first")
        self.model, self.every, self.backend = model, every, backend
        self.measure_eval, self.all_reduce, self.group = measure_eval, all_reduce, group
        self.flush_every, self.chunk_bytes = flush_every, chunk_bytes
        self._log = _logger_from(log)
        self._auto = steps == "forward"
        self.step = 0              # training passes seen; the next one has this index
        self._due = True           # the next training pass is measured (step % every == 0)
        self._measuring = False    # inside a measured pass: the one flag compiled code reads
        self._training = True
        self._stack: list[str] = []                  # names of the hooked modules now running
        self._pending: dict[str, HeadStats] = {}     # this pass's statistics
        self._records: list[_Record] = []
        self._unlogged = 0
        self._latest: dict[str, HeadStats] | None = None
        self._latest_summary: Summary | None = None
        self._handles: list = []
        self._patches: list = []
        self._saved: list = []                       # (module, attribute, value) to restore
        self._id = next(_IDS)

        modules = dict(model.named_modules())
        self._selected = self._select(layers, modules)
        found = {"zoo": [], "mha": [], "hf": [], "sdpa": []}
        for name, m in modules.items():
            if adapters.is_zoo(m):
                found["zoo"].append(name)
            elif adapters.is_mha(m):
                found["mha"].append(name)
            elif adapters.is_hf_attention(m):
                found["hf"].append(name)
            elif not adapters.is_torch_builtin(m) and adapters.source_calls_sdpa(m):
                found["sdpa"].append(name)
        self._covered = set(found["zoo"]) | set(found["mha"])  # their own SDPA calls: not again
        if not any(found.values()):
            files = sorted({type(m).__module__ for m in modules.values() if not adapters.is_torch_builtin(m)})
            raise ValueError(
                f"attach: found no attention in {type(model).__name__} ({len(modules)} modules searched): "
                "no fastdiag.models attention module (class attribute records_head_stats), no "
                "torch.nn.MultiheadAttention, no Hugging Face transformers *Attention module, and no "
                "call of torch.nn.functional.scaled_dot_product_attention in the source of "
                f"{', '.join(files) or 'any non-torch module'}")
        self.found = found

        _MONITORS[self._id] = self
        _ATTACHED[model] = self
        try:
            for name, m in modules.items():
                kind = "zoo" if name in found["zoo"] else "mha" if name in found["mha"] else None
                if m is model or kind or not adapters.is_torch_builtin(m):
                    self._hook(name, m, kind, root=m is model)
            patches = {adapters.hf_eager_patch(type(modules[n]).__module__) for n in found["hf"]}
            if found["hf"] or found["sdpa"]:
                patches.add(adapters.SDPA_PATCH)
            for patch in patches - {None}:
                patch.add(self)
                self._patches.append(patch)
            for name in found["zoo"]:
                m = modules[name]
                for attr in ("record", "stats", "diag_backend"):
                    if hasattr(m, attr):
                        self._saved.append((m, attr, getattr(m, attr)))
                if hasattr(m, "diag_backend"):
                    m.diag_backend = backend
        except BaseException:
            self.detach()
            raise

    @staticmethod
    def _select(layers, modules) -> set[str]:
        if layers is None:
            return set(modules)
        if callable(layers):
            return {n for n in modules if layers(n)}
        if isinstance(layers, str):
            layers = [layers]
        layers = list(layers)
        unknown = [n for n in layers if n not in modules]
        if unknown:
            raise ValueError(f"layers: no module named {', '.join(map(repr, unknown))} in the model")
        # a listed module selects the attention inside it too (a block selects its attention)
        return {n for n in modules if any(n == l or not l or n.startswith(l + ".") for l in layers)}

    # ---- hooks (these run inside a compiled region: they read bools and names only) -----------

    def _hook(self, name: str, module: torch.nn.Module, kind: str | None, root: bool) -> None:
        selected = name in self._selected
        record_at_attach = getattr(module, "record", False)

        def pre(mod, args, kwargs):
            self._stack.append(name)
            if self._measuring and selected:
                if kind == "zoo":
                    mod.record = True
                elif kind == "mha":
                    self._add(name, adapters.mha_head_stats(mod, args, kwargs, self.backend, self.chunk_bytes))

        def post(mod, args, output):
            if self._stack:
                self._stack.pop()
            if kind == "zoo" and self._measuring and selected:
                if mod.stats is not None:
                    self._add(name, mod.stats)
                mod.record = record_at_attach

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post, always_call=True))
        if root and self._auto:
            # Outermost: a pass begins before the stack hooks above and ends after them. These two
            # run eagerly even when the model is compiled (torch.compile(model) and model.compile()
            # call the root's hooks outside the traced frame), so the step counter is never traced.
            @_eager
            def begin(mod, args, kwargs):
                self._begin(mod.training)

            @_eager
            def end(mod, args, output):
                self._end(mod.training)

            self._handles.append(module.register_forward_pre_hook(begin, with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(end, always_call=True))

    def _begin(self, training: bool) -> None:
        self._training = training
        self._measuring = self._due if training else self.measure_eval
        self._stack = []
        self._pending = {}

    def _end(self, training: bool) -> None:
        self._measuring = False
        self._finish(training)

    def _add(self, name: str, stats: HeadStats) -> None:
        key, i = name or "<root>", 1
        while key in self._pending:  # a module called twice in one pass: "name#1", "name#2", ...
            key = f"{name}#{i}"
            i += 1
        self._pending[key] = stats

    def _on_qk(self, query, key, attn_mask, is_causal, scale) -> None:
        """An SDPA / HF eager call while this model is in a measured pass."""
        name = self._stack[-1] if self._stack else ""
        if name in self._covered or name not in self._selected:
            return
        self._add(name, adapters.qk_head_stats(query, key, attn_mask, is_causal, scale,
                                               self.backend, self.chunk_bytes))

    # ---- end of a pass: eager, outside any compiled graph ---------------------------------------

    def _finish(self, training: bool) -> None:
        pending, self._pending = self._pending, {}
        step = self.step
        if training:
            self.step += 1
            self._due = self.step % self.every == 0
        if pending:
            self._record(step, "train" if training else "eval", pending)

    def _record(self, step: int, mode: str, stats: dict[str, HeadStats]) -> None:
        if self.all_reduce:
            stats = {name: s.all_reduce(self.group) for name, s in stats.items()}
        summary = summarize(stats)
        values = summary.tensors()
        self._latest, self._latest_summary = stats, summary
        self._records.append(_Record(step, mode, list(values),
                                     torch.stack(list(values.values())).double().reshape(-1)))
        self._unlogged += 1
        if self._log is not None and self._unlogged >= self.flush_every:
            self.flush()

    # ---- manual steps (the Lightning callback drives these) -------------------------------------

    def begin_step(self, training: bool = True) -> None:
        """Start a step explicitly (``steps="manual"``): forward passes until `end_step` are measured
        together when the step is due (training) or when ``measure_eval`` (eval)."""
        self._begin(training)

    def end_step(self) -> None:
        self._end(self._training)

    # ---- results (these sync with the host) ---------------------------------------------------

    def _to_host(self) -> None:
        todo = [r for r in self._records if r.host is None]
        if not todo:
            return
        flat = torch.cat([r.values for r in todo]).tolist()  # the one host sync
        offset = 0
        for r in todo:
            n = len(r.keys)
            r.host = {"step": r.step, "mode": r.mode, **dict(zip(r.keys, flat[offset:offset + n]))}
            r.values = None
            offset += n

    def latest(self, mode: str | None = None) -> dict | None:
        """The last record (of ``mode`` "train" or "eval" if given) as host floats:
        step, mode, s_bar, sigma_h, sync/<layer>, spread/<layer>. None before the first record."""
        for r in reversed(self._records):
            if mode is None or r.mode == mode:
                self._to_host()
                return dict(r.host)
        return None

    def history(self, mode: str | None = None) -> list[dict]:
        """All records (optionally only ``mode="train"`` or ``"eval"``) as host floats."""
        self._to_host()
        return [dict(r.host) for r in self._records if mode is None or r.mode == mode]

    def latest_stats(self) -> dict[str, HeadStats] | None:
        """The last record's per-layer `HeadStats` (device tensors, no sync)."""
        return self._latest

    def latest_summary(self) -> Summary | None:
        """The last record's `Summary` (device tensors, no sync)."""
        return self._latest_summary

    @property
    def num_records(self) -> int:
        return len(self._records)

    def flush(self) -> None:
        """Send every record not yet logged to the logger (one host sync for all of them)."""
        self._to_host()
        if self._log is None:
            return
        for r in self._records:
            if not r.logged:
                prefix = "fastdiag/" if r.mode == "train" else "fastdiag_eval/"
                self._log(r.step, {prefix + k: v for k, v in r.host.items() if k not in ("step", "mode")})
                r.logged = True
        self._unlogged = 0

    # ---- lifecycle ------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook and patch and restore the attributes set on the model. Idempotent."""
        if self._id not in _MONITORS:
            return
        try:
            if self._log is not None:
                self.flush()
        finally:
            for handle in self._handles:
                handle.remove()
            for patch in self._patches:
                patch.remove(self)
            for module, attr, value in self._saved:
                setattr(module, attr, value)
            self._handles, self._patches, self._saved = [], [], []
            self._measuring = False
            _MONITORS.pop(self._id, None)
            if _ATTACHED.get(self.model) is self:
                del _ATTACHED[self.model]

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {len(v)}" for k, v in self.found.items() if v)
        state = "attached" if self._id in _MONITORS else "detached"
        return f"Monitor({type(self.model).__name__}, every={self.every}, {kinds}, step={self.step}, {state})"


def attach(model: torch.nn.Module, every: int = 10, layers=None, backend: str = "auto", log=None,
           measure_eval: bool = False, all_reduce: bool = False, group=None, *, flush_every: int = 10,
           steps: str = "forward", chunk_bytes: int = CHUNK_BYTES) -> Monitor:
    """Measure the attention heads of ``model`` from its own training forward passes.

    every: measure training passes 0, every, 2·every, ... (eval passes are not counted).
    layers: module names (a name also selects the modules inside it) or a predicate on the name;
        default all attention found.
    backend: `fastdiag.head_stats` backend ("auto": Triton on CUDA, PyTorch elsewhere).
    log: a TensorBoard ``SummaryWriter`` or a callable ``(step, dict)``; it receives
        ``fastdiag/s_bar``, ``fastdiag/sigma_h``, ``fastdiag/sync/<layer>``, ``fastdiag/spread/<layer>``
        (``fastdiag_eval/...`` for eval passes) every ``flush_every`` records and on `flush`/`detach`.
    measure_eval: also measure every eval-mode pass (recorded with mode "eval" at the current step).
    all_reduce, group: sum the statistics over a torch.distributed group before recording, so
        every rank records the global value (all ranks must run the same passes).
    steps: "forward" (a step is one training forward of ``model``) or "manual" (call
        `Monitor.begin_step` / `Monitor.end_step`, as the Lightning callback does).
    chunk_bytes: the most score memory built at once per attention call for Q/K adapters.

    Returns a `Monitor`, also a context manager; `Monitor.detach` undoes everything.
    """
    return Monitor(model, every=every, layers=layers, backend=backend, log=log,
                   measure_eval=measure_eval, all_reduce=all_reduce, group=group,
                   flush_every=flush_every, steps=steps, chunk_bytes=chunk_bytes)

