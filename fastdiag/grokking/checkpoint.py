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
cannot be written (disk full) is warned about once and the run goes on without; one that cannot be
read, or belongs to another run, is ignored with a warning (the run starts from epoch 0). Files are
read with ``weights_only=True``: a planted checkpoint cannot run code. The caller removes the file once
the run's outcome is safe (written to disk or to the store).
"""
from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Iterable

import torch

from fastdiag.store.files import atomic_path

CHECKPOINT_EVERY_S = 300.0      # default cadence: at most 5 minutes of a run are lost to a kill
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
        """The saved state, or None (no file; or an unreadable, foreign or older one: warned)."""
        if not self.path.exists():
            return None
        try:
            payload = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged file only costs the resume
            warnings.warn(f"checkpoint {self.path}: unreadable ({type(exc).__name__}: {exc}); starting "
                          "from epoch 0", RuntimeWarning, stacklevel=2)
            return None
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT \
                or payload.get("key") != self.key or not isinstance(payload.get("state"), dict):
            warnings.warn(f"checkpoint {self.path}: belongs to another run or fastdiag version; starting "
                          "from epoch 0", RuntimeWarning, stacklevel=2)
            return None
        return payload["state"]

    def remove(self) -> None:
        remove_checkpoint(self.path)


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


CADENCE_HELP = ("When a run saves its checkpoint (right after an evaluation): every N epochs ('500'), every "
                "so many minutes or seconds of training ('5m', '90s'), or 'off'. A rerun resumes from it; it "
                "is removed once the run's outcome is written.")
DEFAULT_CADENCE = f"{CHECKPOINT_EVERY_S / 60:g}m"


def parse_cadence(text: str) -> tuple[float | None, int | None] | None:
    """``--checkpoint-every``: '500' → every 500 epochs, '5m' / '90s' → by wall time, 'off' → None
    (no checkpoints). Returns (every_s, every_epochs); raises ValueError naming checkpoint_every."""
    spec = str(text).strip().lower()
    if spec == "off":
        return None
    try:
        if spec.endswith(("m", "s")):
            seconds = float(spec[:-1]) * (60 if spec.endswith("m") else 1)
            if not 0 <= seconds < float("inf"):
                raise ValueError
            return seconds, None
        epochs = int(spec)
        if epochs < 1:
            raise ValueError
        return None, epochs
    except ValueError:
        raise ValueError(f"checkpoint_every: expected a number of epochs >= 1 ('500'), a time ('5m', '90s') "
                         f"or 'off', got {text!r}") from None


def make_checkpointer(path: str | os.PathLike, key: str, cadence: tuple[float | None, int | None] | None
                      ) -> Checkpointer | None:
    """A Checkpointer at ``path`` for ``parse_cadence``'s result (None: checkpoints off)."""
    if cadence is None:
        return None
    every_s, every_epochs = cadence
    return Checkpointer(path, key, every_s=every_s, every_epochs=every_epochs)


def saved_members(path: str | os.PathLike) -> tuple[str, list[str]] | None:
    """(key, member run ids) of an ensemble pack's checkpoint, or None where it cannot be read. Memory
    mapped: a sweep looks at its packs' checkpoints without reading their tensors."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if payload.get("format") == CHECKPOINT_FORMAT:
            return str(payload["key"]), [str(rid) for rid in payload["state"]["member_ids"]]
    except Exception:  # noqa: BLE001 - unreadable: not resumed (train_ensemble warns if it is given it)
        pass
    return None
