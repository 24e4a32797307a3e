"""Checks of what is read back from a store: its content is untrusted (edited, damaged, foreign), and
a damaged row must raise a StoreError naming the store and the run, never feed a wrong number on."""
from __future__ import annotations

import math
from typing import Callable


class StoreError(ValueError):
    """The file is not a usable fastdiag result store (the message says why, in one line)."""


def checked_config(config, path, run_id: str, check: Callable[[dict], None] | None,
                   identify: Callable[[dict], str] | None = None, label: str | None = None) -> dict:
    """The config of a stored run: a JSON object, valid by ``check`` (which raises ValueError saying
    why not) and, by ``identify`` (config → run id), the config its run id was made from, when they
    are given. A config edited under its id would make a sweep take the stored run for the real one
    and skip it for ever, and analysis report it under the wrong settings."""
    def damaged(why: str) -> StoreError:
        return StoreError(f"store {path}: {label or f'run {run_id}'}: damaged config ({why})")

    if not isinstance(config, dict):
        raise damaged(f"a JSON {type(config).__name__}, not an object")
    if check is not None:
        try:
            check(config)
        except (ValueError, TypeError) as exc:
            raise damaged(" ".join(str(exc).split())) from None
    if identify is not None:
        actual = identify(config)
        if actual != run_id:
            raise damaged(f"not the config this run id was made from, but that of run {actual}: "
                          "edited after the run was registered")
    return config


# Numbers that analysis reads, and the range each must lie in (inclusive): a wrong type or a value out
# of range is damage (a hand edit, another tool), never a measurement; t_grok -50 must not become a
# median, nor test accuracy 7.5 a grokked run. (s̄ is a mean cosine of non-negative vectors, σ_H a
# standard deviation; a little slack for float rounding.)
_COUNT = (0.0, float("inf"))
_FRACTION = (0.0, 1.0)
_RESULT_RANGES = {
    "t_grok_epoch": _COUNT, "t_grok_step": _COUNT, "t_mem_epoch": _COUNT, "t_mem_step": _COUNT,
    "anti_grok_epoch": _COUNT, "n_params": _COUNT, "epochs_run": _COUNT, "steps": _COUNT,
    "final_train_acc": _FRACTION, "final_test_acc": _FRACTION,
    "peak_s_bar": (-1e-6, 1.0 + 1e-6), "peak_sigma_h": (0.0, float("inf")),
}
_TRACE_RANGES = {
    "epoch": _COUNT, "step": _COUNT, "train_acc": _FRACTION, "test_acc": _FRACTION,
    "s_bar": (-1e-6, 1.0 + 1e-6), "sigma_h": (0.0, float("inf")),
}


def _out_of_range(values: dict, ranges: dict) -> str | None:
    """Why one of ``values``' checked numbers is not valid (None when all are)."""
    for key, (low, high) in ranges.items():
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} is {value!r}, expected a number"
        if not math.isfinite(value):          # the store writes NaN as null: a non-finite value is an edit
            return f"{key} is {value!r}, expected a finite number"
        if not low <= value <= high:
            bounds = f"at least {low:g}" if high == float("inf") else f"in [{max(low, 0):g}, {high:.0f}]"
            return f"{key} is {value!r}, expected {bounds}"
    return None


def check_result(result, path, run_id: str) -> None:
    if result is None:
        raise StoreError(f"store {path}: run {run_id}: damaged result (a done run with no result)")
    if not isinstance(result, dict):
        raise StoreError(f"store {path}: run {run_id}: damaged result (a JSON {type(result).__name__}, not an object)")
    if not isinstance(result.get("regime"), str):
        raise StoreError(f"store {path}: run {run_id}: damaged result (regime is {result.get('regime')!r}, "
                         "expected a string)")
    why = _out_of_range(result, _RESULT_RANGES)
    if why:
        raise StoreError(f"store {path}: run {run_id}: damaged result ({why})")


def check_trace_row(row, path, run_id: str, idx: int) -> None:
    if not isinstance(row, dict):
        raise StoreError(f"store {path}: run {run_id}: damaged trace row {idx} (not a JSON object)")
    why = _out_of_range(row, _TRACE_RANGES)
    if why:
        raise StoreError(f"store {path}: run {run_id}: damaged trace row {idx} ({why})")
