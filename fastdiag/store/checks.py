"""Checks of what is read back from a store: its content is untrusted (edited, damaged, foreign), and
a damaged row must raise a StoreError naming the store and the run, never feed a wrong number on."""
from __future__ import annotations

from typing import Callable


class StoreError(ValueError):
    """The file is not a usable fastdiag result store (the message says why, in one line)."""


def checked_config(config, path, run_id: str, check: Callable[[dict], None] | None) -> dict:
    """The config of a stored run: a JSON object, and valid by ``check`` (which raises ValueError
    saying why not) when one is given."""
    def damaged(why: str) -> StoreError:
        return StoreError(f"store {path}: run {run_id}: damaged config ({why})")

    if not isinstance(config, dict):
        raise damaged(f"a JSON {type(config).__name__}, not an object")
    if check is not None:
        try:
            check(config)
        except (ValueError, TypeError) as exc:
            raise damaged(" ".join(str(exc).split())) from None
    return config


# Result fields that analysis reads, and what they must be.
_RESULT_NUMBERS = ("t_grok_epoch", "t_grok_step", "t_mem_epoch", "t_mem_step", "anti_grok_epoch", "n_params",
                   "final_train_acc", "final_test_acc", "peak_s_bar", "peak_sigma_h", "epochs_run", "steps")


def check_result(result, path, run_id: str) -> None:
    if result is None:
        raise StoreError(f"store {path}: run {run_id}: damaged result (a done run with no result)")
    if not isinstance(result, dict):
        raise StoreError(f"store {path}: run {run_id}: damaged result (a JSON {type(result).__name__}, not an object)")
    if not isinstance(result.get("regime"), str):
        raise StoreError(f"store {path}: run {run_id}: damaged result (regime is {result.get('regime')!r}, "
                         "expected a string)")
    for key in _RESULT_NUMBERS:
        value = result.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise StoreError(f"store {path}: run {run_id}: damaged result ({key} is {value!r}, expected a number)")
