"""How a sweep's grid is spelt: weight decays, seeds, comma lists and shards, parsed here (torch-free),
so that `fastdiag sweep` refuses a bad grid at once, before it loads torch. `fastdiag.sweep.grid`
combines the parsed values into the runs."""
from __future__ import annotations

import math
import re

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


# A grid larger than this is a typo (1e-3:1:100000000), not an experiment: refuse it before building it.
MAX_GRID_RUNS = 100_000


def parse_wd(spec: str) -> list[float]:
    """``"0.01,0.1,1"`` → those values; ``"1e-3:2:13"`` → 13 log-spaced values from 1e-3 to 2."""
    text = str(spec).strip()
    if not text:
        raise ValueError("weight_decays: empty weight-decay grid")
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3 or not all(re.fullmatch(_NUMBER, s.strip()) for s in parts[:2]) \
                or not re.fullmatch(r"[-+]?\d+", parts[2].strip()):
            raise ValueError(f"weight_decays: bad range {text!r}; expected START:STOP:COUNT, e.g. 1e-3:2:13 "
                             "(COUNT log-spaced values from START to STOP)")
        start, stop, count = float(parts[0]), float(parts[1]), int(parts[2])
        if not 1 <= count <= MAX_GRID_RUNS:
            raise ValueError(f"weight_decays: range count must be >= 1 and at most {MAX_GRID_RUNS}, got {count}")
        if not (start > 0 and stop > 0 and math.isfinite(start) and math.isfinite(stop)):
            raise ValueError(f"weight_decays: a log-spaced range needs START > 0 and STOP > 0, got "
                             f"{start:g}:{stop:g}; list 0 explicitly (e.g. 0,0.01,0.1) if you want it")
        if count == 1:
            if start != stop:
                raise ValueError(f"weight_decays: a range of 1 value needs START = STOP, got {start:g}:{stop:g}")
            return [start]
        a, b = math.log10(start), math.log10(stop)
        values = [10.0 ** (a + (b - a) * i / (count - 1)) for i in range(count)]
        values[0], values[-1] = start, stop          # the end points exactly as written
        return [float(f"{v:.6g}") for v in values]
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"weight_decays: empty item in {text!r}")
        if not re.fullmatch(_NUMBER, item):
            raise ValueError(f"weight_decays: {item!r} is not a number")
        value = float(item)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"weight_decays: weight decay must be a finite number >= 0, got {item}")
        values.append(value + 0.0)          # -0 is 0: the same run, so the same run id (not "-0.0")
    return sorted(set(values))


def parse_seeds(spec: str | int) -> list[int]:
    """``"5"`` → seeds 0..4 (a count); ``"2-5"`` → seeds 2..5 (a range, both ends included);
    ``"0,3,7"`` → those seeds; ``"0-2,7"`` → 0, 1, 2, 7; ``"7,"`` → seed 7 alone (a one-item list)."""
    text = str(spec).strip()
    if not text:
        raise ValueError("seeds: empty")
    if "," not in text and "-" not in text.lstrip("+-"):
        if not re.fullmatch(r"[-+]?\d+", text):
            raise ValueError(f"seeds: expected a count N (seeds 0..N-1), a range A-B or a comma list, got {text!r}")
        n = int(text)
        if not 1 <= n <= MAX_GRID_RUNS:
            raise ValueError(f"seeds: the count must be >= 1 and at most {MAX_GRID_RUNS}, got {n}")
        return list(range(n))
    items = text.split(",")
    if len(items) > 1 and not items[-1].strip():
        items.pop()
    seeds: set[int] = set()
    for item in items:
        item = item.strip()
        span = re.fullmatch(r"(\d+)\s*-\s*(\d+)", item)
        if span:
            first, last = int(span[1]), int(span[2])
            if first > last:
                raise ValueError(f"seeds: the range {item!r} is empty (its first seed is above its last)")
            if last - first + 1 + len(seeds) > MAX_GRID_RUNS:
                raise ValueError(f"seeds: more than {MAX_GRID_RUNS} seeds in {text!r}")
            seeds.update(range(first, last + 1))
        elif re.fullmatch(r"\d+", item):
            seeds.add(int(item))
        else:
            raise ValueError(f"seeds: {item!r} is not a seed (an integer >= 0) or a range A-B")
    return sorted(seeds)


def parse_list(spec: str, name: str) -> list[str]:
    items = [s.strip() for s in str(spec).split(",")]
    if not items or any(not s for s in items):
        raise ValueError(f"{name}: empty item in {spec!r}")
    return list(dict.fromkeys(items))


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``"i/n"`` (0 ≤ i < n) → (i, n); None → None."""
    if spec is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(spec))
    if not m:
        raise ValueError(f"shard: expected I/N with 0 <= I < N (e.g. 0/4), got {spec!r}")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard: expected I/N with 0 <= I < N, got {spec!r}")
    return i, n
