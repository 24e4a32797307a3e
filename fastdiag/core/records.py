"""What a `Monitor` measured: one record per measured step, kept on the device until it is read
(``latest``, ``history``: one host sync for everything not read yet) or sent to a logger.

Statistics with leading problem dimensions (a vectorised ensemble's members, `fastdiag.models.ensemble`)
give each value as a flat list over them, in the host dicts as in what a logger receives."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from fastdiag.core.stats import HeadStats, Summary, summarize

_MERGE_EVERY = 64    # passes kept unsummed at most (memory: a few H x H matrices each)


@dataclass
class _Record:
    step: int
    mode: str                      # "train" or "eval"
    keys: list[str]                # "s_bar", "sigma_h", "sync/<layer>", "spread/<layer>"
    values: torch.Tensor | None    # float64 [len(keys), *leading dims] on the device until converted
    host: dict | None = None
    logged: bool = field(default=False)


def logger_from(log):
    """A callable ``(step, dict)`` from a SummaryWriter (``add_scalar``) or a callable; None stays None."""
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


class Records:
    """The records of one monitor, and its logger (sent every ``flush_every`` records)."""

    def __init__(self, log=None, flush_every: int = 10, all_reduce: bool = False, group=None,
                 keep: bool = True) -> None:
        self.log = logger_from(log)
        self.flush_every, self.all_reduce, self.group = flush_every, all_reduce, group
        self.keep = keep               # False: only the merged statistics, no record per step
        self._records: list[_Record] = []
        self._unlogged = 0
        self.latest_stats: dict[str, HeadStats] | None = None
        self.latest_summary: Summary | None = None
        self._merged: dict[str, dict[str, HeadStats]] = {}   # mode -> layer -> sum since the last reset
        # mode -> the passes' statistics not summed into `_merged` yet: summed when read, or every
        # `_MERGE_EVERY` passes (a measured step adds no op for the merge)
        self._unmerged: dict[str, list[dict[str, HeadStats]]] = {}
        # layer -> its ``invalid`` counts summed over every merged pass, both modes, kept across resets:
        # what `Monitor` names at a host read (added at merge time: a measured step adds no op for it)
        self._invalid: dict[str, torch.Tensor] = {}
        self.invalid_version = 0       # counts additions to `_invalid`: nothing new, nothing to read

    def add(self, step: int, mode: str, stats: dict[str, HeadStats]) -> None:
        if self.all_reduce:
            stats = {name: s.all_reduce(self.group) for name, s in stats.items()}
        unmerged = self._unmerged.setdefault(mode, [])
        unmerged.append(stats)
        if len(unmerged) >= _MERGE_EVERY:
            self._merge(mode)
        self.latest_stats = stats
        if not self.keep:
            return
        summary = summarize(stats)
        values = summary.tensors()
        self.latest_summary = summary
        self._records.append(_Record(step, mode, list(values),
                                     torch.stack(list(values.values())).double()))
        self._unlogged += 1
        if self.log is not None and self._unlogged >= self.flush_every:
            self.flush()

    def _merge(self, mode: str) -> None:
        merged = self._merged.setdefault(mode, {})
        for stats in self._unmerged.pop(mode, ()):
            for name, s in stats.items():
                merged[name] = s if name not in merged else merged[name] + s
                self._invalid[name] = s.invalid if name not in self._invalid else self._invalid[name] + s.invalid
                self.invalid_version += 1

    def invalid(self) -> dict[str, torch.Tensor]:
        """Each layer's ``invalid`` counts over every pass recorded so far (device tensors, no sync)."""
        for mode in list(self._unmerged):
            self._merge(mode)
        return dict(self._invalid)

    def merged(self, mode: str, reset: bool = False) -> dict[str, HeadStats]:
        """Each layer's statistics summed over the records of ``mode`` since the last reset."""
        self._merge(mode)
        return self._merged.pop(mode, {}) if reset else dict(self._merged.get(mode, {}))

    def __len__(self) -> int:
        return len(self._records)

    def _to_host(self) -> None:
        todo = [r for r in self._records if r.host is None]
        if not todo:
            return
        flat = torch.cat([r.values.reshape(-1) for r in todo]).tolist()  # the one host sync
        offset = 0
        for r in todo:
            n, size = len(r.keys), r.values[0].numel()
            values = flat[offset:offset + n * size]
            if r.values.dim() > 1:
                values = [values[i * size:(i + 1) * size] for i in range(n)]
            r.host = {"step": r.step, "mode": r.mode, **dict(zip(r.keys, values))}
            r.values = None
            offset += n * size

    def latest(self, mode: str | None = None) -> dict | None:
        for r in reversed(self._records):
            if mode is None or r.mode == mode:
                self._to_host()
                return dict(r.host)
        return None

    def history(self, mode: str | None = None) -> list[dict]:
        self._to_host()
        return [dict(r.host) for r in self._records if mode is None or r.mode == mode]

    def flush(self) -> None:
        """Send every record not yet logged to the logger (one host sync for all of them). A logger
        that raises (a full disk) is warned about and never breaks the training step or `detach`:
        the records it did not take stay in `history` and are sent again at the next flush."""
        self._to_host()
        if self.log is None:
            return
        self._unlogged = 0
        for r in self._records:
            if r.logged:
                continue
            prefix = "fastdiag/" if r.mode == "train" else "fastdiag_eval/"
            try:
                self.log(r.step, {prefix + k: v for k, v in r.host.items() if k not in ("step", "mode")})
            except Exception as error:  # noqa: BLE001 - any logger failure; KeyboardInterrupt passes
                waiting = [w.step for w in self._records if not w.logged]
                warnings.warn(f"fastdiag.attach: the logger raised {type(error).__name__}: {error}; the "
                              f"records of steps {waiting} are not logged yet (kept in Monitor.history(), "
                              "sent again at the next flush)", RuntimeWarning, stacklevel=3)
                return
            r.logged = True
