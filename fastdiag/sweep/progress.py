"""Progress on stderr: on a terminal a tqdm bar with rate and ETA; elsewhere (logs, pipes, batch jobs),
where a redrawn bar is only noise, a plain line with the same status at the start and then at most
every ``LOG_EVERY_S`` seconds, so that a log shows a long run is alive and how far it got.

``RunProgress`` follows one run's epochs (it is the trainer's ``progress`` callback); ``Progress``
follows a sweep's runs, counting the epochs of runs in flight as fractions of a run so that the ETA
is there before the first run ends."""
from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

from fastdiag.grokking.config import fmt_or_dash

BAR_FORMAT = "{desc}  {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_fmt}]"     # desc: the status


LOG_EVERY_S = 30.0


def is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


class LogLines:
    """Status lines for a stream that is not a terminal: the first one at once, then one when
    ``every_s`` seconds have passed since the last, each with the seconds since the start."""

    def __init__(self, stream, every_s: float = LOG_EVERY_S, clock=time.monotonic) -> None:
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.start = clock()
        self.last: float | None = None

    def __call__(self, text: str, force: bool = False) -> None:
        now = self.clock()
        if force or self.last is None or now - self.last >= self.every_s:
            self.last = now
            print(f"{text}  {now - self.start:.0f}s", file=self.stream, flush=True)


def _width(stream) -> dict:
    """tqdm fits the bar to the terminal's size; a pseudo-terminal that reports 0 columns or 0 lines
    (``script``, ``docker -t`` without a size) would get no bar at all, so it gets 100 × 24."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    return {"ncols": size.columns or 100, "nrows": size.lines or 24}


class RunProgress:
    """One run: call it with each trace row (``epoch``, accuracies, s̄, σ_H)."""

    def __init__(self, epochs: int, stream=None, **log) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.bar = tqdm(total=epochs, desc="run", unit="epoch", file=self.stream, disable=not is_terminal(self.stream),
                        bar_format=BAR_FORMAT, **_width(self.stream))
        self.log = None if is_terminal(self.stream) else LogLines(self.stream, **log)
        self.text = ""

    def __call__(self, row: dict) -> None:
        train, test, s_bar, sigma_h = (fmt_or_dash(row[k], ".3f") for k in ("train_acc", "test_acc", "s_bar", "sigma_h"))
        self.text = f"epoch {row['epoch']}/{self.bar.total}  train {train}  test {test}  s̄ {s_bar}  σ_H {sigma_h}"
        self.bar.set_description_str(self.text, refresh=False)
        self.bar.update(row["epoch"] - self.bar.n)
        if self.log is not None:
            self.log(self.text)

    def close(self) -> None:
        self.bar.close()


class Progress:
    """A sweep: runs done / total, failures, counts per regime so far and the runs in flight."""

    def __init__(self, total: int, skipped: int = 0, stream=None, enabled: bool = True,
                 regimes: dict | None = None, **log) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.total, self.skipped = total, skipped
        self.done_now = self.failed = 0
        self.regimes = dict(regimes or {})
        self.running: dict[str, tuple[int, int]] = {}    # run id -> (epoch, horizon) of runs in flight
        self.bar = tqdm(total=total, initial=skipped, desc="sweep", unit="run", file=self.stream, smoothing=0,
                        disable=not (enabled and is_terminal(self.stream)),
                        bar_format=BAR_FORMAT, **_width(self.stream))
        self.log = LogLines(self.stream, **log) if enabled and not is_terminal(self.stream) else None

    def reset_counts(self, total: int, skipped: int) -> None:
        """The grid's size and the runs finished before this sweep started (known once it is registered)."""
        self.total, self.skipped = total, skipped
        self.bar.reset(total=total)
        self.bar.initial = skipped
        self.show()

    def line(self) -> str:
        """The status: runs done / total, failures, regimes so far, runs in flight."""
        done = self.skipped + self.done_now + self.failed
        parts = [f"sweep: {done}/{self.total} runs"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        regimes = " ".join(f"{r} {n}" for r, n in self.regimes.items() if n)
        if regimes:
            parts.append(regimes)
        if self.running:
            at = sorted(self.running.values(), key=lambda eh: eh[0] / eh[1])
            if len(at) <= 2:
                parts.append("running: epoch " + ", ".join(f"{e}/{h}" for e, h in at))
            else:
                e, h = at[len(at) // 2]
                parts.append(f"{len(at)} running, median at {100 * e // h}% of their epochs")
        return " | ".join(parts)

    def epoch(self, run_id: str, epoch: int, epochs: int) -> None:
        """A run in flight reached ``epoch`` of ``epochs``."""
        self.running[run_id] = (epoch, epochs)
        self.show()

    def update(self, regime: str | None = None, failed: bool = False, force: bool = False,
               run_id: str | None = None) -> None:
        """A run finished (``regime``) or failed; ``force`` redraws at once."""
        self.running.pop(run_id, None)
        if failed:
            self.failed += 1
        else:
            self.done_now += 1
            if regime:
                self.regimes[regime] = self.regimes.get(regime, 0) + 1
        self.show(force=force)

    def note(self, message: str) -> None:
        """A line of its own above the bar (shown wherever the stream goes, terminal or log)."""
        if self.enabled:
            self.bar.write(message, file=self.stream)

    def show(self, force: bool = False) -> None:
        # Runs in flight count as the fraction of their epochs done, so the rate and the ETA move
        # before the first run of a long sweep finishes.
        in_flight = sum(e / h for e, h in self.running.values())
        self.bar.n = self.skipped + self.done_now + self.failed + in_flight
        self.bar.set_description_str(self.line(), refresh=False)
        if force:
            self.bar.refresh()
        else:
            self.bar.update(0)          # redraws at most every mininterval
        if self.log is not None:
            self.log(self.line() + self._left())

    def _left(self) -> str:
        """The ETA the bar would show: the time so far scaled by the runs (and epochs in flight) left."""
        done = self.bar.n - self.skipped
        elapsed = self.log.clock() - self.log.start
        if done <= 0 or self.bar.n >= self.total:
            return ""
        return f" | ~{elapsed * (self.total - self.bar.n) / done:.0f}s left"

    def close(self) -> None:
        if self.log is not None and self.log.last is not None:
            self.log(self.line(), force=True)          # where the sweep ended
        self.bar.close()
