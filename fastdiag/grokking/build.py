"""From a run's configuration to its model: the task shape, the zoo's keyword arguments, the device,
the parameter count, and the one pre-flight check every entry point runs before training."""
from __future__ import annotations

import dataclasses
import functools

import torch

from fastdiag.grokking.config import ARCHS, RunConfig
from fastdiag.grokking.tasks import available_memory, check_task, task_shape
from fastdiag.models import PRESETS, build, count_parameters


def build_kwargs(cfg: RunConfig) -> dict:
    """The `fastdiag.models.build` keyword arguments run ``cfg`` stands for (no device). ``n_layers``
    and ``d_model`` override the architecture's defaults (MLP and LSTM: ``d_model`` is the hidden
    width); ``n_heads`` and ``d_ff`` are transformer only (``d_ff`` is also the MLP's width)."""
    arch = cfg.arch
    if arch not in ARCHS:
        raise ValueError(f"arch: unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")
    vocab_size, seq_len = task_shape(cfg.p)
    kwargs: dict = {"vocab_size": vocab_size, "seq_len": seq_len}
    if arch == "transformer":
        kwargs["preset"] = cfg.preset
        for name in ("n_layers", "n_heads", "d_model", "d_ff"):
            if getattr(cfg, name) is not None:
                kwargs[name] = getattr(cfg, name)
        return kwargs
    if cfg.preset not in ("canonical", "custom"):
        raise ValueError(f"preset: {cfg.preset!r} is a transformer preset; {arch} takes only 'canonical'")
    for name in ("n_heads",) + (("d_ff",) if arch != "mlp" else ()):
        if getattr(cfg, name) is not None:
            raise ValueError(f"{name}: does not apply to arch {arch!r}")
    if cfg.n_layers is not None:
        kwargs["n_layers"] = cfg.n_layers
    width = cfg.d_model if cfg.d_model is not None else (cfg.d_ff if arch == "mlp" else None)
    if width is not None:
        kwargs["hidden" if arch in ("mlp", "lstm") else "d_model"] = width
    return kwargs


def build_model(cfg: RunConfig, device=None) -> torch.nn.Module:
    """The (untrained, freshly initialised) model of run ``cfg``; mamba takes ``device`` to pick its scan."""
    kwargs = build_kwargs(cfg)
    if cfg.arch == "mamba":
        kwargs["device"] = device
    return build(cfg.arch, **kwargs)


def resolve_device(device: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else must be a usable torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} cannot train a run; expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available on this machine")
    return dev


def uses_cuda(cfg: RunConfig) -> bool:
    """Whether run ``cfg`` trains on a GPU (``auto``: when one is available)."""
    return cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())


def check_buildable(cfg: RunConfig, device: bool = False) -> None:
    """Raise ValueError now (not in a worker an hour later) for a config that cannot train: bad values,
    a task that cannot be built (÷ with a composite p, more pairs than memory holds), a model the zoo
    rejects (unknown preset, heads not dividing the width, settings of another architecture) and, with
    ``device``, a device this machine does not have."""
    cfg.validate()
    check_task(cfg.op, cfg.p)
    memory = available_memory()          # read once: /proc/meminfo, for both size checks
    _check_size(cfg, memory)
    n_params = _check_model(cfg.arch, cfg.preset, cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_ff, cfg.p)
    if device:
        resolve_device(cfg.device)
    _check_memory(cfg, n_params, memory)


# Bytes per parameter while training: the weight, its gradient and AdamW's two moments, in float32.
TRAINING_BYTES_PER_PARAMETER = 16
# Layers beyond this are refused before anything is built: even on the meta device, building a model
# costs Python time per layer (10^8 layers would take hours before any memory check could run).
MAX_LAYERS = 10_000


def _check_size(cfg: RunConfig, memory: int | None) -> None:
    """Refuse sizes whose building alone would run for hours or whose weights cannot fit: checked on the
    settings, before the model is built on the meta device."""
    if cfg.n_layers is not None and cfg.n_layers > MAX_LAYERS:
        raise ValueError(f"n_layers: {cfg.n_layers:,} layers is beyond what fastdiag builds (at most {MAX_LAYERS:,})")
    width = max(cfg.d_model or 0, cfg.d_ff or 0)
    need = width ** 2 * TRAINING_BYTES_PER_PARAMETER
    if memory is not None and need > memory:
        name = "d_model" if (cfg.d_model or 0) >= (cfg.d_ff or 0) else "d_ff"
        raise ValueError(f"{name}: {width:,} makes one {width:,} x {width:,} weight matrix alone need "
                         f"{need / 2**30:,.1f} GiB to train; "
                         f"{memory / 2**30:.1f} GiB is available")


def _check_memory(cfg: RunConfig, n: int, memory: int | None) -> None:
    """Refuse a model whose weights, gradients and AdamW state do not fit the memory available now (on
    the CPU; a GPU run is checked against the GPU's memory)."""
    if uses_cuda(cfg) and torch.cuda.is_available():
        dev = resolve_device(cfg.device)
        memory, where = torch.cuda.get_device_properties(dev.index or 0).total_memory, "on the GPU"
    else:
        where = "available"
    need = n * TRAINING_BYTES_PER_PARAMETER
    if memory is not None and need > memory:
        name = "d_model" if cfg.d_model is not None else "n_layers"
        raise ValueError(f"{name}: the model has {n:,} parameters and needs {need / 2**30:,.1f} GiB to "
                         f"train (weights, gradients, AdamW state); {memory / 2**30:.1f} GiB is {where}")


@functools.lru_cache(maxsize=256)
def _check_model(arch, preset, n_layers, n_heads, d_model, d_ff, p) -> int:
    """Build the model on the meta device (no memory, little time): the zoo's own checks, once per
    shape; returns its parameter count."""
    cfg = RunConfig(arch=arch, preset=preset, n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_ff=d_ff, p=p)
    try:
        return _built_count(cfg)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def parameter_count(cfg: RunConfig) -> int | None:
    """Parameters of run ``cfg``'s model (built on the meta device), or None if it cannot be built."""
    try:
        return _built_count(cfg)
    except Exception:  # noqa: BLE001 - only an estimate (sizing a pool, an ensemble)
        return None


def _built_count(cfg: RunConfig) -> int:
    """The model built on the meta device, counted. Past three layers, from the 2- and 3-layer models:
    every zoo architecture stacks identical layers after its first, so the count is linear in the
    layers from there (exact: tests/test_models.py), and the pre-flight check of a 10,000-layer model
    takes milliseconds, not the 10–30 s of building 10,000 layers."""
    if cfg.n_layers is not None and cfg.n_layers > 3:
        two, three = (_meta_count(dataclasses.replace(cfg, n_layers=n)) for n in (2, 3))
        return two + (cfg.n_layers - 2) * (three - two)
    return _meta_count(cfg)


def _meta_count(cfg: RunConfig) -> int:
    with torch.device("meta"):
        return int(count_parameters(build_model(cfg, device=torch.device("meta"))))


def heads_width(config: dict) -> tuple[int, int] | None:
    """(d_model, n_heads) of a transformer run's config dict (preset values filled in), else None."""
    if config.get("arch") != "transformer":
        return None
    preset = PRESETS.get(config.get("preset"), PRESETS["canonical"])
    return int(config.get("d_model") or preset["d_model"]), int(config.get("n_heads") or preset["n_heads"])
