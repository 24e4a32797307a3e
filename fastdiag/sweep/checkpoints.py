"""A sweep's checkpoints: one directory next to the store (``<store>.checkpoints/``), one file per run
training one by one (``<run_id>.ckpt.pt``) and one per ensemble pack (``pack-<key>.ckpt.pt``).

A rerun of a killed sweep resumes each unfinished run from its checkpoint: a pack's unfinished members
are packed together again and resume from the pack's file (members that finished meanwhile are simply
left out). Files are removed as their run or pack ends (done or failed: a failed run is retried from
epoch 0), and the directory once it is empty. Only the local backend checkpoints: a Ray worker on
another node may not see the driver's disk.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable

from fastdiag.grokking import checkpoint as ckpt
from fastdiag.grokking.config import RunConfig

PACK_PREFIX = "pack-"


def checkpoint_dir(store_path: str | os.PathLike) -> Path:
    return Path(f"{store_path}.checkpoints")


class SweepCheckpoints:
    """Where each task of a sweep keeps its checkpoint, and at which cadence (``ckpt.parse_cadence``)."""

    def __init__(self, directory: str | os.PathLike, cadence: tuple[float | None, int | None]) -> None:
        self.directory = Path(directory)
        self.cadence = cadence
        self.saved_packs: dict[str, tuple[Path, str]] = {}     # run id → (pack file, its key)
        self.resuming: set[str] = set()        # runs that started with a checkpoint to resume from
        for path in sorted(self.directory.glob(f"{PACK_PREFIX}*{ckpt.CHECKPOINT_SUFFIX}")):
            found = ckpt.saved_members(path)
            if found is not None:
                key, members = found
                for rid in members:
                    self.saved_packs[rid] = (path, key)

    def regroup(self, todo: list[RunConfig]) -> tuple[list[list[RunConfig]], list[RunConfig]]:
        """(packs to resume: the runs of ``todo`` a saved pack holds, grouped by pack; the other runs)."""
        groups: dict[Path, list[RunConfig]] = {}
        rest = []
        for cfg in todo:
            saved = self.saved_packs.get(cfg.run_id())
            if saved is None:
                rest.append(cfg)
            else:
                groups.setdefault(saved[0], []).append(cfg)
        resumed = [g for g in groups.values() if len(g) > 1]
        rest += [g[0] for g in groups.values() if len(g) == 1]      # one member left: fresh, one by one
        return resumed, rest

    def _where(self, task: list[RunConfig]) -> tuple[Path, str]:
        ids = [c.run_id() for c in task]
        if len(task) == 1:
            return self.directory / f"{ids[0]}{ckpt.CHECKPOINT_SUFFIX}", ids[0]
        saved = {self.saved_packs.get(rid) for rid in ids}
        if len(saved) == 1 and None not in saved:
            return saved.pop()
        key = ckpt.pack_key(ids)
        return self.directory / f"{PACK_PREFIX}{key}{ckpt.CHECKPOINT_SUFFIX}", key

    def spec(self, task: list[RunConfig]) -> dict:
        """What a worker needs to build the task's `Checkpointer` (plain data: it is pickled)."""
        path, key = self._where(task)
        if path.exists():
            self.resuming.update(c.run_id() for c in task)
        every_s, every_epochs = self.cadence
        return {"path": str(path), "key": key, "every_s": every_s, "every_epochs": every_epochs}

    def discard(self, task: list[RunConfig]) -> None:
        """The task ended (its outcome stored) or will not resume (a pack split up): remove its file."""
        path, _ = self._where(task)
        ckpt.remove_checkpoint(path)

    def tidy(self, unfinished: Iterable[str]) -> None:
        """At the end of a sweep: remove files no unfinished run can resume from, then the directory
        if nothing is left in it."""
        unfinished = set(unfinished)
        paths = set(self.directory.glob(f"*{ckpt.CHECKPOINT_SUFFIX}"))
        for tmp in self.directory.glob(f".*.tmp{Path(ckpt.CHECKPOINT_SUFFIX).suffix}"):   # a save killed midway
            if (target := ckpt.checkpoint_of_temporary(tmp)) is not None:
                paths.add(target)
        for path in paths:
            if path.name.startswith(PACK_PREFIX):
                members = ckpt.saved_members(path)
                stale = members is None or not unfinished & set(members[1])
            else:
                stale = path.name.removesuffix(ckpt.CHECKPOINT_SUFFIX) not in unfinished
            if stale:
                ckpt.remove_checkpoint(path)
        with contextlib.suppress(OSError):
            self.directory.rmdir()


def checkpointer(spec: dict | None) -> ckpt.Checkpointer | None:
    """The `Checkpointer` a worker builds from `SweepCheckpoints.spec` (None: no checkpoints)."""
    if spec is None:
        return None
    return ckpt.Checkpointer(spec["path"], spec["key"], every_s=spec["every_s"], every_epochs=spec["every_epochs"])
