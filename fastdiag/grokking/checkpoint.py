"""Checkpoints inside a run: a killed long run resumes where its last checkpoint left it, bit-identically.

A checkpoint is one ``torch.save`` file holding everything the rest of the run depends on: the model's
and the optimiser's state, the batch-order generator, torch's global RNG, the step and epoch counters
and the bookkeeping so far (trace, t_mem, t_grok, divergence). It is taken only right after an
evaluation, where nothing is pending (the merged head statistics and the minibatch-loss sum were just
read and cleared), so the state is small and complete. From it the rest of the run is the same
computation as without the interruption: on CPU the resumed trace equals the uninterrupted one bit
for bit (tests/test_resume.py kills a real ``fastdiag run`` with SIGKILL and compares).

Cadence: after the first evaluation once ``every_s`` seconds (default CHECKPOINT_EVERY_S) have passed
since the last save, or every ``every_epochs`` epochs when that is given. Writes are atomic (a
temporary file, fsync, rename): a kill during a save leaves the previous checkpoint. A checkpoint that
cannot be written (disk full) is warned about once and the run goes on without. A checkpoint that cannot
be restored in full -- not a regular file (a FIFO is never opened: it would block), unreadable,
another run's or fastdiag version's, or not fitting the model, optimizer or config (a weight of another
shape, counters out of range, a non-finite elapsed time, a wrong shuffle state) -- is moved aside to
``<name>.unusable`` (named in a warning) and the run starts from epoch 0: every rerun would otherwise
fail on it the same way. Restoring checks everything (`check_run_state`, `check_pack_state`) before
it touches the trainer. Files are read with ``weights_only=True``: a planted checkpoint cannot run
code. The caller removes the file once the run's outcome is safe (written to disk or to the store).
"""
from __future__ import annotations

import hashlib
import math
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

from contextlib import suppress as contextlib_suppress

import torch

from fastdiag.grokking.config import CHECKPOINT_EVERY_S
from fastdiag.store.files import atomic_path

CHECKPOINT_FORMAT = 1           # bumped when the state's layout changes: an older file is not resumed
CHECKPOINT_SUFFIX = ".ckpt.pt"


class Checkpointer:
    """Where one run (or one ensemble pack) keeps its checkpoint, and when it writes it.

    ``key`` identifies what the state belongs to (a run id; a pack's member ids): a file with another
    key is never resumed. ``every_epochs``: save at the first evaluation at least that many epochs
    after the last save; otherwise ``every_s`` seconds of wall time (0: at every evaluation)."""

    def __init__(self, path: str | os.PathLike, key: str, every_s: float | None = CHECKPOINT_EVERY_S,
                 every_epochs: int | None = None) -> None:
        if every_epochs is not None and every_epochs < 1:
            raise ValueError(f"every_epochs: must be >= 1, got {every_epochs}")
        if every_s is not None and not every_s >= 0:
            raise ValueError(f"every_s: must be >= 0, got {every_s}")
        self.path = Path(path)
        self.key = key
        self.every_s, self.every_epochs = every_s, every_epochs
        self.last_time = time.monotonic()
        self.last_epoch = 0
        self.broken = False          # a save failed: warned once, no more tries
        self.saves = 0
        self.resumed_epoch: int | None = None   # the epoch the run resumed from (None: from the start)

    def due(self, epoch: int) -> bool:
        if self.broken:
            return False
        if self.every_epochs is not None:
            return epoch - self.last_epoch >= self.every_epochs
        return self.every_s is not None and time.monotonic() - self.last_time >= self.every_s

    def save(self, state: dict, epoch: int) -> None:
        """Write ``state`` atomically; a failure (disk full, no directory) is warned about once."""
        payload = {"format": CHECKPOINT_FORMAT, "key": self.key, "state": state}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.path) as tmp:
                with open(tmp, "wb") as fh:
                    torch.save(payload, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
        except (OSError, ValueError) as exc:
            self.broken = True
            warnings.warn(f"checkpoint {self.path}: cannot be written ({exc}); the run goes on without "
                          "checkpoints", RuntimeWarning, stacklevel=2)
            return
        self.saves += 1
        self.last_time, self.last_epoch = time.monotonic(), epoch

    def load(self) -> dict | None:
        """The saved state, or None (no file; or one that is not a regular file, unreadable, foreign or
        older: moved aside with a warning)."""
        try:
            payload = _read_regular(self.path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a damaged file only costs the resume
            self.set_aside(f"unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
            return None
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT \
                or payload.get("key") != self.key or not isinstance(payload.get("state"), dict):
            self.set_aside("belongs to another run or fastdiag version")
            return None
        return payload["state"]

    def resume(self, restore: Callable[[dict], None]) -> bool:
        """Restore the saved state, if any, with ``restore`` (which checks it in full before it changes
        anything); True when the run resumed. A state that does not fit is moved aside (warned) and the
        run starts from epoch 0: False. ``restore`` raising anything at all means the state is unusable."""
        state = self.load()
        if state is None:
            return False
        try:
            restore(state)
        except Exception as exc:  # noqa: BLE001 - a wrong checkpoint must cost the resume, never the run
            self.set_aside(f"does not fit this run ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
            return False
        return True

    def set_aside(self, why: str) -> None:
        """Move the file out of the way (to ``<name>.unusable``, kept for a look) and warn: a rerun must
        not fail on it again."""
        aside = self.path.with_name(self.path.name + ".unusable")
        try:
            os.replace(self.path, aside)
            where = f"moved aside to {aside}"
        except OSError as exc:
            with contextlib_suppress(OSError):
                self.path.unlink()
            where = f"could not be moved aside ({exc.strerror}); removed" if not self.path.exists() else \
                f"could not be moved aside ({exc.strerror})"
        warnings.warn(f"checkpoint {self.path}: {why}; {where}; starting from epoch 0", RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        remove_checkpoint(self.path)


def _read_regular(path: Path, mmap: bool = False):
    """``torch.load`` of ``path`` (weights only), opened only if it is a regular file: a FIFO in its
    place would block the open (and the read) for ever. Raises FileNotFoundError when there is none,
    ValueError for a special file."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError("not a regular file (a FIFO, device, socket or directory)")
    if mmap:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)       # swapped for a FIFO since the stat: no block
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file (a FIFO, device, socket or directory)")
        return torch.load(fh, map_location="cpu", weights_only=True)


class UnusableCheckpoint(ValueError):
    """A checkpoint's state does not fit the run it would resume (the message says what)."""


def _tensor_like(value, like: torch.Tensor, what: str, leading: int | None = None) -> None:
    """``value`` is a tensor with ``like``'s dtype and shape (its first dimension ``leading`` when given)."""
    if not isinstance(value, torch.Tensor):
        raise UnusableCheckpoint(f"{what}: a {type(value).__name__}, expected a tensor")
    shape = tuple(like.shape) if leading is None else (leading, *like.shape[1:])
    if value.dtype != like.dtype or tuple(value.shape) != shape:
        raise UnusableCheckpoint(f"{what}: {value.dtype} {tuple(value.shape)}, expected {like.dtype} {shape}")


def _same_structure(value, like, what: str) -> None:
    """``value`` has ``like``'s structure: the same keys, lengths, tensor dtypes and shapes."""
    if isinstance(like, torch.Tensor):
        _tensor_like(value, like, what)
    elif isinstance(like, dict):
        if not isinstance(value, dict) or set(value) != set(like):
            got = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            raise UnusableCheckpoint(f"{what}: keys {got}, expected {sorted(map(str, like))}"[:400])
        for key in like:
            _same_structure(value[key], like[key], f"{what}[{key!r}]")
    elif isinstance(like, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(like):
            raise UnusableCheckpoint(f"{what}: expected a sequence of {len(like)}")
        for i, (v, ref) in enumerate(zip(value, like)):
            _same_structure(v, ref, f"{what}[{i}]")


def _count(value, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UnusableCheckpoint(f"{what}: {value!r}, expected an integer in [{low}, {high}]")
    return value


# A run's wall time so far: finite, not negative, and less than a century (a larger one is an edit).
_MAX_ELAPSED_S = 100 * 365 * 86400.0


def _check_progress(state: dict, cfg, steps_per_epoch: int, trackers: list) -> int:
    """The counters, elapsed time and bookkeeping of a state saved right after an evaluation of a run
    not finished yet; returns its epoch."""
    epoch = _count(state.get("epoch"), "epoch", 1, cfg.epochs - 1)
    if epoch % cfg.eval_every:
        raise UnusableCheckpoint(f"epoch: {epoch}, not an evaluation epoch (every {cfg.eval_every})")
    _count(state.get("step"), "step", epoch * steps_per_epoch, epoch * steps_per_epoch)
    elapsed = state.get("elapsed")
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not 0 <= elapsed < _MAX_ELAPSED_S:
        raise UnusableCheckpoint(f"elapsed: {elapsed!r}, expected a finite number of seconds >= 0")
    evaluations = list(range(cfg.eval_every, epoch + 1, cfg.eval_every))
    for i, tracker in enumerate(trackers):
        what = "tracker" if len(trackers) == 1 else f"trackers[{i}]"
        if not isinstance(tracker, dict) or not {"trace", "t_mem", "t_grok", "diverged"} <= set(tracker):
            raise UnusableCheckpoint(f"{what}: expected trace, t_mem, t_grok and diverged")
        trace = tracker["trace"]
        if not isinstance(trace, list) or not all(isinstance(r, dict) for r in trace) \
                or [r.get("epoch") for r in trace] != evaluations:
            raise UnusableCheckpoint(f"{what}: trace rows are not the evaluations up to epoch {epoch}")
        for name in ("t_mem", "t_grok"):
            at = tracker[name]
            if at is not None and not (isinstance(at, (list, tuple)) and len(at) == 2 and at[0] in evaluations
                                       and _count(at[1], f"{what}.{name}", 1, epoch * steps_per_epoch)):
                raise UnusableCheckpoint(f"{what}.{name}: {at!r}, expected None or an evaluation (epoch, step)")
        if not isinstance(tracker["diverged"], bool):
            raise UnusableCheckpoint(f"{what}.diverged: expected true or false")
    return epoch


def _check_rng(state: dict, template: dict) -> None:
    """torch's CPU generator state, and the CUDA one where both have it (`set_rng_state` restores
    what is there: a state saved on a CPU may resume on a GPU)."""
    rng = state.get("rng")
    if not isinstance(rng, dict) or "cpu" not in rng or not set(rng) <= {"cpu", "cuda"}:
        raise UnusableCheckpoint("rng: expected torch's generator states ('cpu', and 'cuda' where used)")
    for name in set(rng) & set(template["rng"]):
        _tensor_like(rng[name], template["rng"][name], f"rng[{name!r}]")


def check_run_state(state: dict, template: dict, params: list[torch.Tensor], cfg, steps_per_epoch: int) -> None:
    """Raise UnusableCheckpoint unless ``state`` (a `Trainer.state`) can resume the run whose fresh
    trainer has ``template`` (its own ``state()``), ``params`` (its model's parameters, in order) and
    ``cfg``: the model's keys, dtypes and shapes, the optimizer's groups and moments, the generators,
    the counters and the bookkeeping. Nothing is changed."""
    if not isinstance(state, dict) or set(state) != set(template):
        raise UnusableCheckpoint(f"state: keys {sorted(map(str, state))}, expected {sorted(template)}")
    _check_progress(state, cfg, steps_per_epoch, [state["tracker"]])
    _same_structure(state["model"], template["model"], "model")
    _tensor_like(state["shuffle"], template["shuffle"], "shuffle")
    _check_rng(state, template)
    opt, fresh = state["optimizer"], template["optimizer"]
    if not isinstance(opt, dict) or set(opt) != set(fresh) or not isinstance(opt.get("state"), dict):
        raise UnusableCheckpoint("optimizer: not an optimizer state of this run")
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(fresh["param_groups"]):
        raise UnusableCheckpoint("optimizer: parameter groups differ")
    for group, ref in zip(groups, fresh["param_groups"]):
        if not isinstance(group, dict) or any(group.get(k) != ref[k] for k in
                                               ("params", "lr", "betas", "eps", "weight_decay") if k in ref):
            raise UnusableCheckpoint("optimizer: parameter groups differ (parameters, lr, betas, eps or weight decay)")
    for key, moments in opt["state"].items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(params) or not isinstance(moments, dict):
            raise UnusableCheckpoint(f"optimizer: state of an unknown parameter {key!r}")
        for name in ("exp_avg", "exp_avg_sq"):
            _tensor_like(moments.get(name), params[key].detach(), f"optimizer state {key} {name}")
        step = moments.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or not 0 <= float(step) <= state["step"]:
            raise UnusableCheckpoint(f"optimizer state {key} step: expected a count in [0, {state['step']}]")


def check_pack_state(state: dict, template: dict, ids: list[str], cfg, steps_per_epoch: int) -> None:
    """Like `check_run_state` for an ensemble pack's state (`_pack_state`): every run of ``ids`` among
    its members, and every stacked tensor with one row per saved member, the fresh pack's ``template``
    (its own state, one row per member of ``ids``) giving the dtypes and other dimensions."""
    if not isinstance(state, dict) or set(state) != set(template):
        raise UnusableCheckpoint(f"state: keys {sorted(map(str, state))}, expected {sorted(template)}")
    members = state["member_ids"]
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members) \
            or len(set(members)) != len(members) or not set(ids) <= set(members):
        raise UnusableCheckpoint("member_ids: holds other members than this pack's (or is not a list of distinct run ids)")
    k = len(members)
    for name in ("trackers", "shuffles"):
        if not isinstance(state[name], list) or len(state[name]) != k:
            raise UnusableCheckpoint(f"{name}: expected one per member ({k})")
    _check_progress(state, cfg, steps_per_epoch, state["trackers"])
    for name in ("params", "exp_avg", "exp_avg_sq"):
        if not isinstance(state[name], list) or len(state[name]) != len(template[name]):
            raise UnusableCheckpoint(f"{name}: expected {len(template[name])} tensors")
        for i, (value, like) in enumerate(zip(state[name], template[name])):
            _tensor_like(value, like.detach(), f"{name}[{i}]", leading=k)
    _tensor_like(state["decay"], template["decay"], "decay", leading=k)
    for i, shuffle in enumerate(state["shuffles"]):
        _tensor_like(shuffle, template["shuffles"][0], f"shuffles[{i}]")
    _count(state["step_count"], "step_count", 0, state["step"])
    _check_rng(state, template)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove a checkpoint and any temporary file a save killed midway left beside it."""
    path = Path(path)
    path.unlink(missing_ok=True)
    for tmp in path.parent.glob(f".{path.stem}.*.tmp{path.suffix}"):   # atomic_path's naming
        tmp.unlink(missing_ok=True)


def checkpoint_of_temporary(tmp: Path) -> Path | None:
    """The checkpoint a leftover temporary file (``.<stem>.<random>.tmp<suffix>``) was to replace."""
    name = tmp.name
    if not (name.startswith(".") and ".tmp" in name):
        return None
    stem, _, rest = name[1:].rpartition(".tmp")
    return tmp.with_name(stem.rpartition(".")[0] + rest)


def pack_key(run_ids: Iterable[str]) -> str:
    """The key (and file name stem) of an ensemble pack's checkpoint: its members' run ids, in order."""
    return hashlib.sha256(",".join(run_ids).encode()).hexdigest()[:16]


def checkpoint_path(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory) / f"{key}{CHECKPOINT_SUFFIX}"


def rng_state(device: torch.device) -> dict:
    """torch's global generators (CPU, and the device's on CUDA): nothing in training draws from
    them today, but a model that does (dropout) must resume with the same draws."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def tracker_state(tracker) -> dict:
    """A `RunTracker`'s bookkeeping so far (its trace rows are plain floats: saved exactly)."""
    return {"trace": [dict(row) for row in tracker.trace], "t_mem": tracker.t_mem, "t_grok": tracker.t_grok,
            "diverged": tracker.diverged}


def restore_tracker(tracker, state: dict) -> None:
    tracker.trace = [dict(row) for row in state["trace"]]
    tracker.t_mem = tuple(state["t_mem"]) if state["t_mem"] is not None else None
    tracker.t_grok = tuple(state["t_grok"]) if state["t_grok"] is not None else None
    tracker.diverged = bool(state["diverged"])


def make_checkpointer(path: str | os.PathLike, key: str, cadence: tuple[float | None, int | None] | None
                      ) -> Checkpointer | None:
    """A Checkpointer at ``path`` for ``config.parse_cadence``'s result (None: checkpoints off)."""
    if cadence is None:
        return None
    every_s, every_epochs = cadence
    return Checkpointer(path, key, every_s=every_s, every_epochs=every_epochs)


def saved_members(path: str | os.PathLike) -> tuple[str, list[str]] | None:
    """(key, member run ids) of an ensemble pack's checkpoint, or None where it cannot be read. Memory
    mapped: a sweep looks at its packs' checkpoints without reading their tensors."""
    try:
        payload = _read_regular(Path(path), mmap=True)
        if payload.get("format") == CHECKPOINT_FORMAT:
            return str(payload["key"]), [str(rid) for rid in payload["state"]["member_ids"]]
    except Exception:  # noqa: BLE001 - unreadable: not resumed (train_ensemble warns if it is given it)
        pass
    return None
