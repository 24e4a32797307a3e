"""`fastdiag.attach(model)`: head diagnostics inside an existing training loop, model unchanged.

    monitor = fastdiag.attach(model, every=10)   # before or after torch.compile / DDP wrapping
    ...train as usual...
    monitor.latest()     # {"step": 40, "mode": "train", "s_bar": ..., "sigma_h": ..., "sync/<layer>": ...}
    monitor.detach()     # hooks removed, the model is as it was

Steps are the model's training-mode forward passes. On every `every`-th one (steps 0, every,
2·every, ...) each attention layer's `HeadStats` is computed on the device from that same forward
pass (see `fastdiag.core.adapters` for how each kind of attention is seen and measured) and kept there;
the host sees the values only when they are read (`latest`, `history`) or a logger is flushed.

Attention is found by what modules do on a measured pass: the innermost running module that calls
SDPA or takes a softmax over ``[B, H, Tq, Tk]`` scores is an attention layer, reported by its name.
At attach time the monitor also expects attention where the structure says so (fastdiag's models,
`torch.nn.MultiheadAttention`, the innermost modules whose class is named like attention); after
each measured pass any expected module without statistics is warned about once (``strict=True``:
raised), and a model in which nothing at all was found is an error.

torch.compile: `torch.compile(model)` and `model.compile()` call the root module's hooks outside
the traced frame. The root's begin/end hooks are `torch.compiler.disable`d, so the step counter
lives in plain Python, and the `AttentionMode` is entered only for a measured pass; everything inside
the forward (submodule hooks, the mode) depends on that one fact, so a compiled model has two
graphs, measured and not, and the unmeasured one is the model's own.

Faults: a logger that raises is warned about, never breaks a step or `detach`; a forward pass that
raises is not a step and leaves no record; a copy of the model (deepcopy, pickle, torch.save) gets
inert hooks, no monitor; nested monitors share the zoo modules' original attributes and never take
each other's statistics computations for attention.
"""
from __future__ import annotations

import functools
import itertools
import sys
import threading
import warnings
import weakref

import torch

from fastdiag.core import adapters, calls, compiled_root, passes, zoo_handoff
from fastdiag.core.calls import ROOT
from fastdiag.core.diagnostics import BACKENDS, triton_available
from fastdiag.core.kernels import qk_stats_cpu
from fastdiag.core.qk import CHUNK_BYTES
from fastdiag.core.plan import Plan, PlanRecorder
from fastdiag.core.records import Records
from fastdiag.core.stats import HeadStats, Summary

__all__ = ["Monitor", "attach"]

HOW = {"zoo": "the module's own probabilities (records_head_stats)",
       "mha": "Q and K re-projected with the MultiheadAttention weights",
       "mha_forward": "Q and K re-projected with the weights of its multi_head_attention_forward call",
       "probabilities": "the softmax output the model used",
       "probabilities with sink": "the softmax output the model used, over its keys and its attention-sink column",
       "sdpa": "re-derived from the SDPA call's Q, K, mask and scale"}
_LOOKED_FOR = ("looked for fastdiag.models attention (class attribute records_head_stats), "
               "torch.nn.MultiheadAttention, modules whose class is named like attention, and, on a "
               "measured forward pass, modules that call scaled_dot_product_attention or take a "
               "softmax over [B, H, Tq, Tk] scores")
# Why a layer's statistics come out invalid (NaN): named at the next host read (`Monitor._name_invalid`)
INVALID_WHY = ("probabilities with a non-finite score, an attention op's log-sum-exp that disagrees with the "
               "scores, or, on the Triton pass 2 (CUDA), sharp rows whose float32 scores are too large to hold the "
               "input dtype's exactness target (1e-5 float32, 1e-3 bf16/fp16: |s| beyond ~5800 for 16-bit "
               "inputs, or q·k products that cancel: ‖q‖·‖k‖·|scale| beyond ~2900); docs/attach.md, 'Sharp rows'")

# torch's own attributes of every module (hook dicts, parameters, ...): never another model held by it
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
HELD_ITEMS = 256   # the most items of a list, tuple, set or dict attribute looked into for modules held there
_CONTAINERS = (list, tuple, set, frozenset, dict)

_MONITORS: dict[int, "Monitor"] = {}
_IDS = itertools.count()
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, Monitor]" = weakref.WeakKeyDictionary()


def _eager(fn):
    """Never traced by torch.compile (a pass's begin and end: they read and write the step counter)."""
    return torch.compiler.disable(fn, recursive=True)


def _no_op_hook(*args):
    return None


def _inert():
    return _no_op_hook


class _Hook(functools.partial):
    """A monitor's hook as it sits in a module's hook dict. A copy of the module (``copy.deepcopy``,
    pickle, ``torch.save``) gets a no-op in its place: a copy carries no monitor and is never measured.
    A `functools.partial`: calling it adds no Python frame (every hooked module's call runs two, on
    unmeasured passes too)."""
    __slots__ = ()

    def __reduce__(self):
        return _inert, ()


class _EagerHook:
    """The root's begin and end: run by torch.compile outside the traced frame, never traced. Its
    ``__call__`` is disabled for torch.compile when the first one is made (at attach), not when this
    module is imported: `torch.compiler.disable` imports torch._dynamo (1.3 s), which a command that
    never attaches (most of the CLI) does not need."""
    __slots__ = ("fn",)
    _disabled = False

    def __init__(self, fn):
        self.fn = fn
        if not _EagerHook._disabled:
            _EagerHook.__call__ = _eager(_EagerHook.__call__)
            _EagerHook._disabled = True

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce__(self):
        return _inert, ()


def _held_modules(modules) -> list[torch.nn.Module]:
    """The modules that ``modules`` hold outside their module tree: in a plain attribute
    (``object.__setattr__``), or as an item of a list, tuple, set or dict (up to `HELD_ITEMS` items)
    held in one. One level only: never an arbitrary object graph."""
    held, module_class = [], torch.nn.Module
    for module in modules:
        attributes = vars(module)
        for key in attributes.keys() - _MODULE_INTERNALS:
            # by type(), not isinstance: isinstance reads a value's __class__, which a Hugging Face config
            # serves through its own __getattribute__ (twice the cost of the whole scan)
            value = attributes[key]
            kind = type(value)
            if issubclass(kind, module_class):
                held.append(value)
            elif issubclass(kind, _CONTAINERS) and len(value) <= HELD_ITEMS:
                held.extend(item for item in (value.values() if issubclass(kind, dict) else value)
                            if issubclass(type(item), module_class))
    return held


# torch.nn modules with an eval fast path that a torch function mode turns off (their outputs then differ)
_FAST_PATH_MODULES = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)


def _foreign_marker(module: torch.nn.Module) -> str:
    """`Monitor._suspended`'s entry for another model's fast-path module (this model's own are its names)."""
    return f"<outside the model: {id(module)}>"


def _unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, list]:
    """``torch.compile(model)`` returns a wrapper; hook the module inside it (same names, same hooks).
    The module, and the wrappers around it."""
    wrappers = []
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                    torch.nn.Module):
        wrappers.append(model)
        model = model._orig_mod
    return model, wrappers


def _plain_name(name: str) -> str:
    """A module's name without torch.compile's ``_orig_mod`` (``blocks._orig_mod.layers.0`` is ``blocks.layers.0``,
    the name it has when compiled after attach or not at all). The wrapper, listed first, gives way to the module."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _calling_frame():
    """The frame of the module call whose hook runs this (``Module._call_impl``), or None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not torch.nn.Module._call_impl.__code__:
        frame = frame.f_back
    return frame


def _cpu_kernel_ready(model: torch.nn.Module) -> bool:
    """At a measured pass's begin (eager, also when the model runs compiled): a model on the CPU gets the
    native CPU kernel built now, so that a compiled pass traces its op (`qk_stats_cpu.usable` builds
    nothing while tracing). Without it a first measured pass that is compiled took the torch path, whose
    chunk sizes are Python arithmetic on the shapes: a graph break with dynamic shapes (fullgraph=True
    raised in the step). Whether that is settled (built, not buildable here, or the model not on the CPU
    yet: False, asked again at the next measured pass)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if first is None or first.device.type != "cpu":
        return False
    qk_stats_cpu.unavailable_reason()      # builds it (where not switched off)
    return True


class Monitor:
    """Measures an attached model's attention heads; see `attach` for the arguments."""

    def __init__(self, model: torch.nn.Module, every: int = 10, layers=None, backend: str = "auto",
                 log=None, measure_eval: bool = False, all_reduce: bool = False, group=None,
                 flush_every: int = 10, steps: str = "forward", chunk_bytes: int = CHUNK_BYTES,
                 strict: bool = False, keep_records: bool = True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if adapters.is_scripted(model):
            raise TypeError(f"model: expected an eager torch.nn.Module, got a TorchScript module "
                            f"({type(model).__name__}): its ops run where no hook or function mode sees them; "
                            "attach the module before torch.jit.script or torch.jit.trace")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected a positive integer, got {every!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every: expected a positive integer, got {flush_every!r}")
        if steps not in ("forward", "manual"):
            raise ValueError(f"steps: expected 'forward' or 'manual', got {steps!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: expected a positive integer (bytes), got {chunk_bytes!r}")
        if backend == "triton" and not triton_available():
            raise ValueError("backend: 'triton' needs triton and a CUDA device, or TRITON_INTERPRET=1 set "
                             "before import to run the kernel in the interpreter")
        if not isinstance(strict, bool):
            raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
        if not isinstance(keep_records, bool):
            raise TypeError(f"keep_records: expected a bool, got {type(keep_records).__name__}")
        if not keep_records and log is not None:
            raise ValueError("log: a logger receives the records, and keep_records=False keeps none")
        model, wrappers = _unwrap_compiled(model)
        if model in _ATTACHED:
            raise ValueError("model: already attached; detach the other monitor first")
        self.model, self.every, self.backend = model, every, backend
        self._own_frame: compiled_root.OwnFrame | None = None   # a torch.nn root's frame (`compiled_root`)
        self._pass_frame = None          # the root's call running the pass in progress (`_pass_abandoned`)
        self._cpu_kernel_ready = False   # `_cpu_kernel_ready`: the native CPU kernel built (or not buildable)
        self.measure_eval, self.all_reduce, self.group = measure_eval, all_reduce, group
        self.flush_every, self.chunk_bytes, self.strict = flush_every, chunk_bytes, strict
        self._records = Records(log, flush_every, all_reduce, group, keep_records)
        self._auto = steps == "forward"
        self.step = 0              # training passes seen; the next one has this index
        self._due = True           # the next training pass is measured (step % every == 0)
        self._measuring = False    # inside a measured pass: the one flag compiled code reads
        self._pass_thread: int | None = None  # the thread whose pass is running; others' are not seen
        self._training = True
        self._mode_entered = False
        self._plans: dict[tuple, Plan] = {}          # (training, autocast) -> the plan of lean passes
        self._calls = itertools.count()
        self._all_rows: dict[str, str] = {}          # layers whose padding rows could not be told, and why
        self._padding_rows: dict[str, torch.Tensor] = {}  # layer -> rows its mask left out as padding positions
        #                                       (device counts of the last measured pass that called it)
        self._how: dict[str, str] = {}               # every module measured so far and how
        self._missing: dict[str, str] = {}           # expected modules never measured, and why
        self._warned: set = set()                    # what `_warn_once` has said
        self._named_invalid: set[str] = set()        # layers whose invalid statistics were named
        self._invalid_read = 0                       # `Records.invalid_version` at the last check
        self._warned_padding: set[tuple] = set()     # set_padding shapes already warned about
        self._handles: list = []
        self._zoo: list[torch.nn.Module] = []       # fastdiag-model attention whose attributes are set
        self._id = next(_IDS)

        # the root is named ROOT everywhere (records, coverage, warnings), its children by their own names;
        # a TorchScript submodule (and all inside it) runs unseen: left out, and named if it does attention
        # torch.compile's wrapper of a part is no part of its layers' names (the part itself takes its place)
        modules = {_plain_name(name) or ROOT: m for name, m in model.named_modules()}
        scripted = [n for n, m in modules.items() if adapters.is_scripted(m)
                    and not any(n.startswith(o + ".") for o in modules if o != n and adapters.is_scripted(modules[o]))]
        modules = {n: m for n, m in modules.items() if not any(n == o or n.startswith(o + ".") for o in scripted)}
        self._modules = modules
        self._selected = self._select(layers, modules)
        self._kind = {name: "zoo" if adapters.is_zoo(m) else "mha"
                      for name, m in modules.items() if adapters.is_zoo(m) or adapters.is_mha(m)}
        self._sinks = {name: sinks for name, m in modules.items() if (sinks := adapters.sink_logits(m)) is not None}
        # the attention calls of measured passes: handed over by the mode, turned into statistics there
        self.calls = calls.AttentionCalls(modules, self._kind, self._selected, self._sinks, backend, chunk_bytes,
                                          self._warn_once)
        self._mode = adapters.AttentionMode(self.calls)
        named = {name for name, m in modules.items() if adapters.named_attention(m)}
        innermost = {n for n in named if not any(o.startswith(n + ".") for o in named if o != n)}
        self._expected = [n for n in modules if (n in self._kind or n in innermost) and n in self._selected]
        # torch's eval fast paths (MultiheadAttention's native path, the encoder layer's fused kernel,
        # nested tensors) are off whenever a torch function mode is active: the mode is left out of
        # these modules in eval mode, so their outputs stay bit-identical (`_suspend_mode`)
        # and nn.TransformerEncoderLayer takes its fused kernel only when no hook sits on it or inside it:
        # the modules inside one are hooked only for measured training passes (`_lazy`)
        encoder_layers = [n for n, m in modules.items()
                          if isinstance(m, torch.nn.TransformerEncoderLayer) and m is not model]
        self._lazy = {n for n in modules for layer in encoder_layers if n == layer or n.startswith(layer + ".")}
        self._fast_path = {name for name, m in modules.items() if name not in self._lazy and isinstance(
            m, (torch.nn.TransformerEncoder, torch.nn.MultiheadAttention))}
        self._suspended: list[str] = []              # fast-path modules running with the mode left out
        self._lazy_hooks: list[tuple] = []           # (name, module, kind) hooked on measured training passes
        self._lazy_handles: list = []
        self._foreign_handles: list = []             # global module hooks, held during measured passes only
        # the modules whose own code can hold and call another model: torch.nn's hold torch's attributes only
        self._holders = [m for m in modules.values() if m is model or not adapters.is_torch_builtin(m)]
        # by id (a module may define __eq__ and no hash), never keeping a module alive
        self._held_seen = weakref.WeakValueDictionary()    # modules held outside the tree, looked at already
        self._held_hooked = weakref.WeakValueDictionary()  # modules of other models held by this one, hooked
        # looked for again at each measured pass's begin until one has finished, and for good once one was
        # compiled (eager passes have the global hooks: no cost of it there after the first)
        self._held_rescan = "first"
        if not self._expected and all(adapters.is_torch_builtin(m) for m in modules.values()):
            raise ValueError(f"attach: found no attention in {type(model).__name__}: {_LOOKED_FOR}; "
                             "it is made of torch.nn modules only, none of them attention")

        for name in scripted:
            if adapters.scripted_attention(model.get_submodule(name)):
                reason = ("a TorchScript module: its softmax or attention op runs inside TorchScript, where attach "
                          "cannot see it; attach the model before scripting that part")
                message = f"fastdiag.attach: attention module {name!r} is not measured: {reason}"
                if strict:
                    raise ValueError(message)
                self._missing[name] = reason
                warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.calls.read_stack = calls.stack_reader_ready()
        _MONITORS[self._id] = self
        _ATTACHED[model] = self
        try:
            for name, m in modules.items():
                if m is model or name in self._kind or name in self._fast_path or not adapters.is_torch_builtin(m):
                    if name in self._lazy:
                        self._lazy_hooks.append((name, m, self._kind.get(name)))
                    else:
                        self._hook(name, m, self._kind.get(name), root=m is model)
            self._watch_held_models()
            self._handles.append(torch.nn.modules.module.register_module_module_registration_hook(
                self._on_submodule_set))
            if self._auto:      # the root's step hooks, kept out of compiled graphs
                self._own_frame = compiled_root.give_own_frame(model, wrappers)
                if self._own_frame is not None:
                    self._handles.append(self._own_frame)
            for name, kind in self._kind.items():
                if kind == "zoo":
                    zoo_handoff.hold(modules[name], self._id, self.backend)
                    self._zoo.append(modules[name])
        except BaseException:
            self.detach()
            raise

    @staticmethod
    def _select(layers, modules) -> set[str]:
        if layers is None:
            return set(modules)
        if callable(layers):
            return {n for n in modules if layers("" if n == ROOT else n)}
        if isinstance(layers, str):
            layers = [layers]
        layers = [l or ROOT if isinstance(l, str) else l for l in layers]
        unknown = [n for n in layers if n not in modules]
        if unknown:
            raise ValueError(f"layers: no module named {', '.join(map(repr, unknown))} in the model")
        # a listed module selects the attention inside it too (a block selects its attention)
        return {n for n in modules if any(n == l or l == ROOT or n.startswith(l + ".") for l in layers)}

    # ---- padding ---------------------------------------------------------------------------------

    def set_padding(self, mask: torch.Tensor | None, within: str | torch.nn.Module | None = None) -> None:
        """Mark this step's padding: ``mask`` ``[B, T]``, True / 1 = real token, False / 0 = padding
        (a Hugging Face ``attention_mask``). In every self-attention call of the step with batch B and
        T query rows, the padding rows are left out (docs/attach.md, "Padding"), on top of what the attention masks
        themselves say. ``within``: only the attention inside this module (a name or the module
        itself: an encoder-decoder's encoder); another call replaces the mask for that module. It
        holds until the step ends (the forward pass, or `end_step`); None clears every mask. A mask
        that matches no self-attention call of a measured pass is warned about (a ``[T, B]`` mask)."""
        if mask is None:
            self.calls.padding = []
            return
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"mask: expected a [batch, seq] tensor (True or 1 = real token), got "
                             f"{type(mask).__name__ if not isinstance(mask, torch.Tensor) else tuple(mask.shape)}")
        if mask.is_complex() or mask.layout != torch.strided:
            raise TypeError(f"mask: expected a dense bool, integer or float tensor, got {mask.dtype} ({mask.layout})")
        if isinstance(within, torch.nn.Module):
            names = [n for n, m in self._modules.items() if m is within]
            if not names:
                raise ValueError(f"within: a {type(within).__name__} that is not part of the attached model")
            within = names[0]
        elif within == "":
            within = ROOT
        elif within is not None and (not isinstance(within, str) or within not in self._modules):
            raise ValueError(f"within: no module named {within!r} in the model")
        if mask.is_meta:
            raise ValueError("mask: a meta tensor has no values; pass the real-token mask itself ([batch, seq], "
                             "True or 1 = real token)")
        real = mask.detach() if mask.dtype == torch.bool else mask.detach() != 0
        self.calls.padding = [(w, m) for w, m in self.calls.padding if w != within] + [(within, real)]

    def _check_padding(self, step: int) -> None:
        """After a measured pass: a handed-in mask that no self-attention call used is named once."""
        if not self.calls.padding or self.calls.state.padding_used:
            return
        shapes = tuple(tuple(m.shape) for _, m in self.calls.padding)
        if shapes in self._warned_padding:
            return
        self._warned_padding.add(shapes)
        warnings.warn(f"fastdiag.attach: set_padding's mask of shape {', '.join(map(str, shapes))} matched no "
                      f"self-attention call of step {step} (it applies to calls with that [batch, seq]); "
                      "no padding rows were left out on its account", RuntimeWarning, stacklevel=3)

    # ---- hooks (these run inside a compiled region: they read bools and names only) -----------

    def _hook(self, name: str, module: torch.nn.Module, kind: str | None, root: bool, handles=None) -> None:
        handles = self._handles if handles is None else handles
        selected = name in self._selected
        record_at_attach = getattr(module, "record", False)

        def pre(mod, args, kwargs):
            if not self._measuring or self._other_thread():
                if self._pass_thread is None and not root and self._auto and not adapters.tracing():
                    self._outside_pass(name, mod)
                return
            state = self.calls.state
            if torch.compiler.is_compiling():
                # compiled: no provenance; calls numbered from 0 in every pass (the count starts equal on
                # every pass, so the graph never recompiles for it; a global counter would), so that two
                # attention ops in one call are told (`calls._add_op`)
                call = state.compiled_calls
                state.compiled_calls += 1
                state.recorder = None   # no plan from a compiled pass: its modules' calls are not recorded
            else:
                if root and not self._foreign_handles:
                    self._watch_foreign_modules()
                call = next(self._calls)
                if state.plan is not None and not state.careful:
                    self._follow_plan(state, name, call, args, kwargs)
                else:
                    self.calls.provenance.seed(call, args, kwargs)
                    if state.recorder is not None:
                        state.recorder.module_call(name, call, args, kwargs)
            state.stack.append((name, call))
            state.called.add(name)
            fast_path = name in self._fast_path and not mod.training
            if selected and kind == "zoo":
                mod.record = True
            elif selected and kind == "mha":
                device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
                dtype = None if device is None else adapters.autocast_dtype(device.type)
                padding = lambda n, t, dev: self.calls.with_padding(None, n, t, dev, name)  # noqa: E731
                self.calls.add(name, adapters.own_statistics(adapters.mha_head_stats, mod, args, kwargs,
                                                        self.backend, self.chunk_bytes, padding, dtype), "mha")
            if (fast_path or kind == "zoo" and self._only_monitor_mode()) and not self._suspended:
                self._suspend_mode(name)
            if fast_path and torch.compiler.is_compiling():
                # traced, the mode cannot be left: torch's slow path runs inside it, whose attention ops
                # belong to layers named as not measured on eval passes (`_begin`), never to this module
                state.fast_path.add(name)

        def post(mod, args, output):
            if not self._measuring or self._other_thread():
                return
            state = self.calls.state
            if state.stack:
                _, call = state.stack.pop()
                if state.undo:
                    self._after_planned_call(state, name, call)
            if self._suspended and self._suspended[-1] == name:
                self._resume_mode()
            if kind == "zoo" and selected:
                if isinstance(mod.stats, dict):  # a module holding several layers (an ensemble): layer -> stats
                    for layer, stats in mod.stats.items():
                        self.calls.add(layer if name == ROOT else f"{name}.{layer}", stats, "zoo")
                elif mod.stats is not None:
                    self.calls.add(name, mod.stats, "zoo")
                mod.record = record_at_attach

        handles.append(module.register_forward_pre_hook(_Hook(pre), with_kwargs=True))
        handles.append(module.register_forward_hook(_Hook(post), always_call=True))
        if root and self._auto:
            # Outermost: a pass begins before the stack hooks above and ends after them. These two
            # run eagerly even when the model is compiled (torch.compile(model) and model.compile()
            # call the root's hooks outside the traced frame), so the step counter is never traced.
            # torch.export (non-strict: it runs these hooks) traces the model, it is no step: the exported
            # program stays the model's own (no statistics in it), the counter does not move
            def begin(mod, args, kwargs):
                if self._pass_thread is not None and self._pass_abandoned():
                    self._end(self._training, raised=True)
                if self._pass_thread is None and not torch.compiler.is_exporting():
                    self._begin(mod.training)
                    self._pass_frame = _calling_frame()

            def end(mod, args, output):
                if self._other_thread() or torch.compiler.is_exporting():
                    return
                # always_call: also runs when the forward raised (output None, inside torch's except)
                self._end(mod.training, raised=output is None and sys.exc_info()[0] is not None)

            self._handles.append(module.register_forward_pre_hook(_EagerHook(begin), with_kwargs=True,
                                                                  prepend=True))
            self._handles.append(module.register_forward_hook(_EagerHook(end), always_call=True))

    def _on_submodule_set(self, parent: torch.nn.Module, name: str, submodule) -> None:
        """torch's module registration hook (``parent.name = submodule``, ``ModuleList[i] = ...``), held while
        attached: a module of this model set after attach carries none of the monitor's hooks, so attention in
        it cannot be measured. Where it replaces a layer (or a module holding one) or brings attention of its
        own (named like it, MultiheadAttention, a zoo module), that is named now and listed in ``missing`` —
        never a layer silently left out of s̄. A part with no attention (a LoRA wrapper) is quiet."""
        if self._own_frame is not None and submodule is self.model and name == "_orig_mod":
            self._own_frame.adopt(parent)      # torch.compile(model) while attached (`compiled_root`)
        if id(parent) not in self.calls.ids or not isinstance(submodule, torch.nn.Module):
            return
        where = next((n for n, m in self._modules.items() if m is parent), None)
        if where is None:
            return
        full = name if where == ROOT else f"{where}.{name}"
        old = parent._modules.get(name)
        if old is not None and (getattr(submodule, "_orig_mod", None) is old or getattr(old, "_orig_mod", None)
                                is submodule):
            return      # torch.compile's wrapper set in place of the module it wraps, or taken off: still hooked
        known = [*self._how, *self._expected, *self._kind]
        lost = [] if old is None or old is submodule else sorted(
            {n for n in known if n == full or n.startswith(full + ".")})
        # before the first pass only the structure is known: a replaced module of the model's own code (hooked,
        # maybe attention) is named too; a torch.nn leaf (a projection wrapped by LoRA) is not
        brings = any(adapters.is_mha(m) or adapters.is_zoo(m) or adapters.named_attention(m)
                     for m in submodule.modules()) or (old is not None and not adapters.is_torch_builtin(old)
                                                       and not self._how)
        if not lost and not brings:
            return
        reason = (f"{full!r} was set to a new {type(submodule).__name__} after "
                  "attach: the new module carries none of the monitor's hooks, so its attention is not measured "
                  "(and not in s_bar); detach and attach again to measure it")
        for layer in lost or [full]:
            self._missing[layer] = (f"{full!r} was set to a new {type(submodule).__name__} after attach: not "
                                    "hooked, its attention is not measured; detach and attach again")
        self._warn_once(f"replaced {full}", reason)

    def _outside_pass(self, name: str, module: torch.nn.Module) -> None:
        """A hooked module ran with no forward pass of the attached model around it (``model.forward(x)``
        called directly skips the root's hooks, which count and measure steps; or a part called on its
        own): where that would have been measured, said once, never a silent nothing."""
        if torch._C._current_graph_task_id() != -1 or torch.compiler.is_exporting():
            return      # run inside a backward pass (activation checkpointing recomputing it), or traced by torch.export
        here = threading.get_ident()
        if any(other is not self and other._pass_thread == here and id(module) in other.calls.ids
               for other in list(_MONITORS.values())):
            return      # a module shared with another attached model, run by that model's pass: measured there
        if (module.training and torch.is_grad_enabled()) or self.measure_eval:
            self._warn_once("outside a pass", f"{name!r} ({type(module).__name__}) ran outside any forward pass "
                            f"of the attached {type(self.model).__name__} (model.forward(...) called directly "
                            "skips the hooks that count and measure steps; or a part called on its own): "
                            "nothing there is measured; call the model itself, or attach the part you call")

    # ---- lean passes (fastdiag.core.plan) ----------------------------------------------------------

    def _follow_plan(self, state, name: str, call: int, args: tuple, kwargs: dict) -> None:
        """A hooked module's call on a lean pass: a planned attention call enters the mode (lean);
        anything the plan does not expect is handled carefully from here, and drops the plan."""
        index = state.runs.get(name, 0)
        state.runs[name] = index + 1
        events, on_plan = state.plan.expected(name, index, args, kwargs)
        if not on_plan:
            state.off_plan = True
            state.careful += 1
            self.calls.provenance.seed(call, args, kwargs)
            state.undo[call] = self._mode_for_call(lean=False)
        elif events:
            state.events[call] = (events, [0])
            state.undo[call] = self._mode_for_call(lean=True)

    def _mode_for_call(self, lean: bool):
        """Enter the mode for one module call (lean: SDPA and softmax only), or set its kind if it is
        entered already; returns what `_after_planned_call` restores."""
        if self._mode_entered:
            previous, self._mode.lean = self._mode.lean, lean and self._mode.lean
            return ("lean", previous)
        self._mode.lean = lean
        self._mode.__enter__()
        self._mode_entered = True
        return ("exit", None)

    def _after_planned_call(self, state, name: str, call: int) -> None:
        undo = state.undo.pop(call, None)
        if undo is None:
            return
        planned = state.events.pop(call, None)
        if planned is not None and planned[1][0] != len(planned[0]):
            state.off_plan = True      # fewer attention ops than planned: this layer is missing, say it next pass
        elif planned is None:
            state.careful -= 1
        what, previous = undo
        if what == "lean":
            self._mode.lean = previous
        elif self._mode_entered:
            self._mode_entered = False
            if not self._suspended:
                self._mode.__exit__(None, None, None)
            self._mode.lean = False

    def _plan_key(self, training: bool) -> tuple:
        return (training, torch.is_grad_enabled(), adapters.autocast_dtype("cpu"), adapters.autocast_dtype("cuda"))

    def _suspend_mode(self, name: str) -> None:
        """Leave the mode out of module ``name``: a fast-path module in eval (with a mode active torch
        takes its slow path, whose outputs differ: nested-tensor padding 0 vs 2.3, 1e-6 elsewhere; its
        MultiheadAttention is measured by its adapter, which needs no mode), or a zoo module, which
        measures itself (nothing the mode sees inside it is measured: it would only cost time)."""
        if torch.compiler.is_compiling() or not self._mode_entered:
            return
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is self._mode:
            self._mode.__exit__(None, None, None)
            self._suspended.append(name)

    def _only_monitor_mode(self) -> bool:
        """No other monitor's mode is active: with nested monitors each suspends its own mode in a zoo
        module and resumes it in hook order, which would swap the modes on torch's stack."""
        if torch.compiler.is_compiling():
            return False
        return not any(isinstance(m, adapters.AttentionMode) and m is not self._mode
                       for m in torch.overrides._get_current_function_mode_stack())

    def _resume_mode(self) -> None:
        self._suspended.pop()
        self._mode.__enter__()

    def _other_thread(self) -> bool:
        """Whether this hook runs in another thread than the pass in progress (an evaluation thread
        running the same model): that pass is neither a step nor measured. Compiled code skips the
        check (one thread per measured graph run)."""
        return (not torch.compiler.is_compiling() and self._pass_thread is not None
                and self._pass_thread != threading.get_ident())

    def _begin(self, training: bool) -> None:
        self._pass_thread = threading.get_ident()
        self._training = training
        self._measuring = self._due if training else self.measure_eval
        if self._measuring and torch._C._functorch.peek_interpreter_stack() is not None:
            self._measuring = False      # a torch.func transform: step aside, never break the step
            self._warn_once("transform", "a forward pass under a torch.func transform (vmap, grad, jacrev, "
                            "functional_call inside one) is not measured: its tensors are batched or "
                            "differentiated per sample, and the statistics' ops have no batching rules; "
                            "passes outside transforms are measured as usual")
        self.calls.provenance.clear()
        self._place_lazy_hooks(training)
        if not self._measuring:
            self.calls.state = passes.IDLE
            return
        if not self._cpu_kernel_ready:
            self._cpu_kernel_ready = _cpu_kernel_ready(self.model)
        if self._held_rescan != "no":  # a model held since attach (a teacher set later) is hooked too
            self._watch_held_models()
        # fresh every pass: a compiled graph sees the same state on every pass
        plan = self._plans.get(self._plan_key(training)) if len(_MONITORS) == 1 else None
        self.calls.state = passes.PassState(plan=plan, recorder=None if plan is not None else PlanRecorder())
        if not training:
            for name, module, kind in self._lazy_hooks:
                if kind == "mha" and name in self._selected:
                    self.calls.refuse(name, "an eval pass: nn.TransformerEncoderLayer keeps torch's eval fast path (one "
                                       "fused kernel, no probabilities, and no hooks allowed inside it), so its "
                                       "attention is measured on training passes only")
        if plan is None and not self._mode_entered:   # careful: the mode sees the whole forward
            self._mode.lean = False
            self._mode.__enter__()
            self._mode_entered = True

    def _place_lazy_hooks(self, training: bool) -> None:
        """The hooks inside nn.TransformerEncoderLayers (`_lazy`): held from a training pass until an eval
        pass, which torch runs through its fused kernel only with no hook on or inside the layer. Held
        across a training run's passes, measured or not: a compiled model guards on its hook dicts, and
        hooks put on and taken off every measured pass recompiled it each time (new hook ids)."""
        if training and self._lazy_hooks and not self._lazy_handles:
            for name, module, kind in self._lazy_hooks:
                self._hook(name, module, kind, False, self._lazy_handles)
        elif not training and self._lazy_handles:
            for handle in self._lazy_handles:
                handle.remove()
            self._lazy_handles = []

    def _pass_abandoned(self) -> bool:
        """Whether the pass in progress was left by a BaseException (a KeyboardInterrupt: torch runs the
        root's always_call end hook for an Exception only), so the root's call that began it is no longer
        running in this thread: its mode, global hooks and layers would otherwise be taken into the next
        pass (a layer ``#1`` averaged into s̄). A root called inside its own forward is no such pass."""
        if self._pass_thread != threading.get_ident() or self._pass_frame is None:
            return False
        frame = sys._getframe(1)
        while frame is not None:
            if frame is self._pass_frame:
                return False
            frame = frame.f_back
        return True

    def _end(self, training: bool, raised: bool = False) -> None:
        self._pass_thread = self._pass_frame = None
        if self._mode_entered:
            self._mode_entered = False
            if not self._suspended:  # a suspended mode is off the stack already
                self._mode.__exit__(None, None, None)
            self._suspended = []
            self._mode.lean = False
        measured, self._measuring = self._measuring, False
        if measured and not raised:
            self.calls.unconfirmed()
        self.calls.provenance.clear()
        for handle in self._foreign_handles:
            handle.remove()
        self._foreign_handles = []
        if measured and not raised:
            self._check_padding(self.step)
            self._learn(training)
        self.calls.padding = []
        self._finish(training, measured, raised)

    def _watch_foreign_modules(self) -> None:
        """For a measured pass: a module outside the attached model (a frozen teacher, a reward model, an
        encoder kept in a list) that runs inside it is put on the pass's module stack as foreign
        (``(None, module)``), so that its attention is not taken for a layer of the module calling it
        (`AttentionCalls._attention_call`). torch's global module hooks see every module call; they are
        held from the root's call to the pass's end, on passes that are not compiled (a compiled graph
        guards on the global hooks: hooks held on some passes only would recompile it; its provenance is
        not tracked either, see docs/attach.md)."""
        self._foreign_handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._foreign_enter),
            torch.nn.modules.module.register_module_forward_hook(self._foreign_leave, always_call=True)]

    def _watch_held_models(self) -> None:
        """Other models held by this one outside its module tree (`_held_modules`: a frozen teacher in a
        list or a plain attribute) get hooks of their own, held while attached, which put their modules on
        the stack of a measured pass as foreign where the global hooks are not held (compiled passes,
        `_watch_foreign_modules`). Looked for at attach and at each measured pass's begin (eager); a held
        module whose tree holds this model's modules (a back-reference) is no other model."""
        for held in _held_modules(self._holders):
            if id(held) in self.calls.ids or self._held_seen.get(id(held)) is held:
                continue
            self._held_seen[id(held)] = held
            tree = dict(held.named_modules())
            if any(id(m) in self.calls.ids for m in tree.values()):
                continue
            # torch takes nn.TransformerEncoderLayer's fused eval kernel only with no hook on or inside it
            encoders = [n for n, m in tree.items() if isinstance(m, torch.nn.TransformerEncoderLayer)]
            for name, m in tree.items():
                if self._held_hooked.get(id(m)) is m or adapters.is_torch_builtin(m) and not m._modules \
                        or any(name == n or name.startswith(n + ".") or not n for n in encoders):
                    continue
                self._held_hooked[id(m)] = m
                self._hook_held(m)

    def _hook_held(self, module: torch.nn.Module) -> None:
        """Hooks on a module of another model held by this one: on a measured pass without the global
        hooks (compiled), it is on the stack as foreign while it runs. Traced into a compiled graph: they
        read bools and push a name only."""
        entry = (None, type(module).__name__)

        def watching() -> bool:      # a measured pass of this thread without the global hooks
            return self._measuring and not self._foreign_handles and not self._other_thread()

        def pre(mod, args):
            if watching():
                self.calls.state.stack.append(entry)

        def post(mod, args, output):
            if watching():
                stack = self.calls.state.stack
                if stack and stack[-1][0] is None:
                    stack.pop()

        self._handles.append(module.register_forward_pre_hook(_Hook(pre)))
        self._handles.append(module.register_forward_hook(_Hook(post), always_call=True))

    def _foreign_enter(self, module, args) -> None:
        """A torch.nn leaf made on the fly (``nn.Softmax(-1)(s)``) is the calling module's own code, not another
        model. Another model's torch.nn fast-path module in eval runs with the mode left out, as this model's
        own do (`_suspend_mode`): its outputs stay bit-identical, and nothing in it is this model's attention.
        Neither hook acts where torch.compile traces it (a compiled submodule of an eager root: a compiled
        pass tells another model by where it is held and by dynamo's stack; reading this stack there made
        dynamo raise in the step), nor on a torch.compile wrapper of this model's module set after attach."""
        if id(module) in self.calls.ids or torch.compiler.is_compiling() or not self._measuring \
                or self._other_thread() or adapters.is_torch_builtin(module) and not module._modules \
                or id(getattr(module, "_orig_mod", None)) in self.calls.ids:
            return
        self.calls.state.stack.append((None, module))
        if isinstance(module, _FAST_PATH_MODULES) and not module.training and not self._suspended:
            marker = _foreign_marker(module)
            self._suspend_mode(marker)
            if self._suspended and self._suspended[-1] == marker:
                self._warn_once(("foreign fast path", type(module)),
                                f"{type(module).__name__}, a module outside the attached model, runs in eval on "
                                "torch's fast path inside a measured pass: its attention is not recorded as a layer "
                                "of this model; attach that model itself to measure it as its own")

    def _foreign_leave(self, module, args, output) -> None:
        if id(module) in self.calls.ids or torch.compiler.is_compiling():   # this model's own first: most calls
            return
        if self._suspended and self._suspended[-1] == _foreign_marker(module):
            self._resume_mode()
        stack = self.calls.state.stack
        if stack and stack[-1][0] is None and stack[-1][1] is module:
            stack.pop()

    def _learn(self, training: bool) -> None:
        """After a measured pass: a careful pass that met nothing it could not measure leaves the plan of
        the lean passes after it; a lean pass that met something unexpected drops it."""
        state, key = self.calls.state, self._plan_key(training)
        if state.plan is not None:
            if state.off_plan:
                self._plans.pop(key, None)
            return
        if state.recorder is None or state.refused or state.undecided or state.candidates or state.lse \
                or self._lazy_hooks or len(_MONITORS) != 1 or torch.compiler.is_compiling():
            return
        plan = state.recorder.plan()
        if plan is not None:
            self._plans[key] = plan

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"fastdiag.attach: {message}", RuntimeWarning, stacklevel=4)

    # ---- end of a pass: eager, outside any compiled graph ---------------------------------------

    def _finish(self, training: bool, measured: bool, raised: bool = False) -> None:
        pending = self.calls.state.pending
        step = self.step
        if raised:  # not a step: nothing recorded (part of a pass is no number), the next pass is due again
            return
        if self.calls.state.compiled_calls:
            self.calls.enclosing_compiled()
        if measured and self._held_rescan != "always":
            self._held_rescan = "always" if self.calls.state.compiled_calls else "no"
        for name in self.calls.state.refused:  # one module = one exact layer record, or none and a warning
            key = name
            pending = {k: v for k, v in pending.items() if k != key and not k.startswith(key + "#")}
            self.calls.state.how.pop(name, None)
        if training:
            self.step += 1
            self._due = self.step % self.every == 0
        if measured:  # not after a pass that raised: what it did not reach is not missing
            self._check_coverage(step)
        if pending:
            self._record(step, "train" if training else "eval", pending)

    def _check_coverage(self, step: int) -> None:
        """After a measured pass: nothing found is an error; an expected module without statistics
        is warned about once (raised with strict)."""
        self._how.update(self.calls.state.how)
        self._padding_rows.update(self.calls.state.padding_rows)
        for (name, why), flag in self.calls.state.undecided.items():   # said at the next host read
            self.calls.suspect(name, flag, why)
        for name, reason in self.calls.state.refused.items():
            if name in self._missing:
                continue
            self._missing[name] = reason
            message = (f"fastdiag.attach: attention module {name!r} ({type(self._modules[name]).__name__}) is "
                       f"not measured: {reason}")
            if self.strict:
                self.detach()
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        if not self._expected and not self._how and not self._missing:
            # Said, never raised inside the user's step (strict=True asks for the error): the monitor
            # detaches, the model runs on as without it
            message = (f"fastdiag.attach: found no attention in {type(self.model).__name__} on its measured pass "
                       f"(step {step}): {_LOOKED_FOR}; nothing is measured and the monitor detached itself")
            self.detach()
            if self.strict:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            return
        measured = list(self.calls.state.how)
        for name in self._expected:
            if name not in self.calls.state.called:
                continue  # not run on this pass (a helper such as Funnel's FunnelAttentionStructure, an unused branch)
            if name in self._missing or name in self.calls.state.refused or any(m == name or m.startswith(name + ".") or name == ROOT for m in measured):
                continue
            reason = (f"no statistics on the measured pass of step {step}: no "
                      "scaled_dot_product_attention call and no softmax over [B, H, Tq, Tk] scores ran "
                      "inside it, or its softmax was never multiplied with values along its key axis "
                      "(attention it computes some other way — flash-attn, xformers, a fused or 3-D "
                      "kernel, flex attention, a windowed layout — cannot be measured)")
            self._missing[name] = reason
            message = f"fastdiag.attach: attention module {name!r} ({type(self._modules[name]).__name__}): {reason}"
            if self.strict:
                self.detach()
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _read_suspects(self) -> None:
        """At a host read: a layer whose padding rows may have been counted (`calls.suspect`: XLNet's
        padding, unknown provenance, a memory prefix) is named once, and in ``coverage()["all_rows"]``."""
        suspects, self.calls.suspects = self.calls.suspects, {}
        for (name, why), flag in suspects.items():
            if name not in self.calls.suspects_named and bool(flag):
                self._name_all_rows(name, why)
        self._name_invalid()

    def _name_invalid(self) -> None:
        """At a host read: a layer whose statistics came out invalid on some recorded pass (its s_l and
        σ_l are NaN there) is named once, with why that happens (``strict=True``: a RuntimeError)."""
        counts = self._records.invalid()
        if self._records.invalid_version == self._invalid_read:
            return                  # no pass recorded since the last read: no host sync for it
        self._invalid_read = self._records.invalid_version
        unnamed = {name: count for name, count in counts.items() if name not in self._named_invalid}
        if not unnamed:
            return
        counts = torch.stack([c.sum().double() for c in unnamed.values()]).tolist()    # one host sync
        for name, count in zip(unnamed, counts):
            if count == 0:
                continue
            self._named_invalid.add(name)
            module = self._modules.get(name)
            message = (f"fastdiag.attach: layer {name!r} ({type(module).__name__}): its statistics are NaN on "
                       f"some measured passes ({count:g} rows or entries could not be measured exactly): "
                       f"{INVALID_WHY}")
            if self.strict:
                self.detach()
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _name_all_rows(self, name: str, why: str) -> None:
        """Layer ``name``'s padding rows could not be told (``why``): listed in ``coverage()["all_rows"]`` and
        warned about once, naming the module (``strict=True``: a RuntimeError, the monitor detached)."""
        if name in self.calls.suspects_named:
            return
        self.calls.suspects_named.add(name)
        self._all_rows.setdefault(name, why)
        module = self._modules.get(name)
        message = f"fastdiag.attach: layer {name!r} ({type(module).__name__}): {why}"
        if self.strict:
            self.detach()
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def coverage(self) -> dict:
        """What attach found and measured so far: ``found`` (module names, expected at attach time or
        seen doing attention on a measured pass), ``measured`` (name → how), ``missing``
        (name → why it has no statistics on a measured pass; a layer measured on other passes is listed
        in both, its reason saying so), ``all_rows`` (measured layers whose padding rows could
        not be told from the call, so every row that sees a key is counted: name → why) and
        ``padding_rows`` (name → the query rows of its last measured pass left out because the mask
        hides their own position from every query: padding, or the real token of a token-drop mask,
        which a mask cannot tell apart; layers with none are not listed)."""
        self._read_suspects()
        found = list(self._expected) + [n for n in self._how if n not in self._expected]
        measured = {name: HOW[how] for name, how in self._how.items()}
        # a layer missing on some measured passes and measured on others is listed in both, so that a
        # gap in its history is never hidden by the passes that did measure it
        missing = {name: reason if name not in self._how else f"{reason} (on some measured passes; measured on others)"
                   for name, reason in self._missing.items()}
        all_rows = {name: why for name, why in self._all_rows.items() if name in self._how}
        padding_rows = {name: int(count) for name, count in self._padding_rows.items() if name in self._how and int(count)}
        return {"found": found, "measured": measured, "missing": missing, "all_rows": all_rows,
                "padding_rows": padding_rows}

    def _record(self, step: int, mode: str, stats: dict[str, HeadStats]) -> None:
        self._records.add(step, mode, stats)

    # ---- manual steps (the Lightning callback drives these) -------------------------------------

    def begin_step(self, training: bool = True) -> None:
        """Start a step explicitly (``steps="manual"``): forward passes until `end_step` are measured
        together when the step is due (training) or when ``measure_eval`` (eval)."""
        self._begin(training)

    def end_step(self) -> None:
        self._end(self._training)

    def set_step(self, step: int) -> None:
        """Continue counting training steps from ``step`` (a loop resumed from a checkpoint taken at
        that step): the next training pass has this index and is measured when ``step % every == 0``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected a non-negative integer, got {step!r}")
        self.step, self._due = step, step % self.every == 0

    # ---- results (these sync with the host) ---------------------------------------------------

    def latest(self, mode: str | None = None) -> dict | None:
        """The last record (of ``mode`` "train" or "eval" if given) as host floats:
        step, mode, s_bar, sigma_h, sync/<layer>, spread/<layer>. None before the first record."""
        self._read_suspects()
        return self._records.latest(mode)

    def history(self, mode: str | None = None) -> list[dict]:
        """All records (optionally only ``mode="train"`` or ``"eval"``) as host floats."""
        self._read_suspects()
        return self._records.history(mode)

    def latest_stats(self) -> dict[str, HeadStats] | None:
        """The last record's per-layer `HeadStats` (device tensors, no sync)."""
        return self._records.latest_stats

    def latest_summary(self) -> Summary | None:
        """The last record's `Summary` (device tensors, no sync)."""
        return self._records.latest_summary

    def merged_stats(self, mode: str = "train", *, reset: bool = False) -> dict[str, HeadStats]:
        """Each layer's `HeadStats` summed with ``+`` over the records of ``mode`` ("train" or "eval")
        since the last ``reset=True`` call (device tensors, no sync): the statistics of all those
        passes' rows together, e.g. an epoch's or an evaluation interval's. {} when none;
        ``reset=True`` starts the next sum."""
        if mode not in ("train", "eval"):
            raise ValueError(f"mode: expected 'train' or 'eval', got {mode!r}")
        return self._records.merged(mode, reset)

    @property
    def num_records(self) -> int:
        return len(self._records)

    def flush(self) -> None:
        """Send every record not yet logged to the logger (`fastdiag.core.records.Records.flush`)."""
        self._read_suspects()
        self._records.flush()

    # ---- lifecycle ------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook, leave the mode if inside a pass and restore the attributes set on the
        model. Idempotent."""
        if self._id not in _MONITORS:
            return
        try:
            if self._records.log is not None:
                self.flush()
        finally:
            for handle in self._handles + self._lazy_handles + self._foreign_handles:
                handle.remove()
            self._lazy_handles, self._foreign_handles = [], []
            if self._mode_entered:  # detached inside a measured pass
                self._mode_entered = False
                if not self._suspended:
                    self._mode.__exit__(None, None, None)
                self._suspended = []
            zoo_handoff.release(self._zoo, self._id)
            self._zoo = []
            self._handles = []
            self._measuring = False
            _MONITORS.pop(self._id, None)
            if _ATTACHED.get(self.model) is self:
                del _ATTACHED[self.model]

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        coverage = self.coverage()
        state = "attached" if self._id in _MONITORS else "detached"
        return (f"Monitor({type(self.model).__name__}, every={self.every}, found={len(coverage['found'])}, "
                f"measured={len(coverage['measured'])}, step={self.step}, {state})")


def attach(model: torch.nn.Module, every: int = 10, layers=None, backend: str = "auto", log=None,
           measure_eval: bool = False, all_reduce: bool = False, group=None, *, flush_every: int = 10,
           steps: str = "forward", chunk_bytes: int = CHUNK_BYTES, strict: bool = False,
           keep_records: bool = True) -> Monitor:
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
    strict: raise (RuntimeError) instead of warning when an attention module found has no
        statistics after a measured pass.
    keep_records: False keeps no record per measured pass (no summary computed, `latest` and
        `history` stay empty, no ``log``): only `Monitor.merged_stats` and `Monitor.latest_stats`,
        for a loop that reads the merged statistics alone (fastdiag's own trainers).

    Padding: `Monitor.set_padding` hands in a step's real-token mask; the attention masks themselves
    are read too (docs/attach.md, "Padding"). `Monitor.coverage` says what was found and how each layer is measured.

    Returns a `Monitor`, also a context manager; `Monitor.detach` undoes everything.
    """
    return Monitor(model, every=every, layers=layers, backend=backend, log=log,
                   measure_eval=measure_eval, all_reduce=all_reduce, group=group,
                   flush_every=flush_every, steps=steps, chunk_bytes=chunk_bytes, strict=strict,
                   keep_records=keep_records)

