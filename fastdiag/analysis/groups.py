"""A store's done runs grouped into experimental conditions (everything equal but λ and seed), and the
per-group analysis: λ_c, ν (fixed and joint), the regime table and the median t_grok per λ."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fastdiag.analysis.bootstrap import FitError, as_float_array, require_same_length
from fastdiag.analysis.fits import fit_lambda_c, fit_nu
from fastdiag.grokking.config import GROKKED, N_BOOT, REGIMES
from fastdiag.grokking.labels import NEVER_FIT_MIN_EPOCHS
from fastdiag.store import Store


def regime_table(lambdas: Sequence[float], regimes: Sequence[str]) -> dict[float, dict[str, int]]:
    """λ (ascending) → {regime: count} for every regime in REGIMES, zeros included."""
    lambdas = as_float_array(lambdas, "lambdas")
    if isinstance(regimes, (str, bytes)) or not hasattr(regimes, "__len__"):
        raise TypeError(f"regimes: expected a sequence of regime names, got {type(regimes).__name__}")
    regimes = list(regimes)
    require_same_length(lambdas=lambdas, regimes=regimes)
    unknown = sorted({repr(r) for r in regimes if r not in REGIMES})
    if unknown:
        raise ValueError(f"regimes: unknown regime(s) {', '.join(unknown)}; expected one of {REGIMES}")
    table = {float(lam): dict.fromkeys(REGIMES, 0) for lam in np.unique(lambdas)}
    for lam, regime in zip(lambdas, regimes):
        table[float(lam)][regime] += 1
    return table


def median_t_grok(lambdas: Sequence[float], t_grok: Sequence[float | None]) -> dict[float, float | None]:
    """λ (ascending) → median t_grok over its grokked runs (finite t_grok), None if none grokked."""
    lambdas = as_float_array(lambdas, "lambdas")
    t_grok = as_float_array(t_grok, "t_grok", allow_nan=True)
    require_same_length(lambdas=lambdas, t_grok=t_grok)
    medians: dict[float, float | None] = {}
    for lam in np.unique(lambdas):
        times = t_grok[(lambdas == lam) & np.isfinite(t_grok)]
        medians[float(lam)] = float(np.median(times)) if times.size else None
    return medians


GROUP_EXCLUDE = ("weight_decay", "seed", "device")


def file_safe(text) -> str:
    """Letters, digits and single dashes only: a name from a store (untrusted) that can be neither a
    path nor a hidden file. Where that changed the text, a short hash of it follows, so that two
    names (``a/b`` and ``a.b``) never become one file."""
    text = str(text)
    safe = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:80] or "unnamed"
    if safe != text:
        safe += "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return safe


@dataclass
class Group:
    """Done runs that differ only in λ and seed: one experimental condition."""

    key: tuple
    config: dict                       # the shared configuration (λ, seed, device removed)
    runs: list = field(default_factory=list)    # store run dicts (status done)
    # Settings (beyond model, task and horizon) in which the store's groups differ, e.g. lr: named in
    # the label and the file names, else two groups share a header and one figure file.
    distinct: dict = field(default_factory=dict)

    def _model_parts(self) -> list[str]:
        """arch [preset] [L.. H.. d.. ff..]"""
        c = self.config
        parts = [c["arch"]]
        if c["arch"] == "transformer" and c.get("preset") not in (None, "custom"):
            parts.append(c["preset"])
        return parts + [f"{short}{c[name]}" for name, short in
                        (("n_layers", "L"), ("n_heads", "H"), ("d_model", "d"), ("d_ff", "ff")) if c.get(name)]

    @property
    def label(self) -> str:
        c = self.config
        return " ".join(self._model_parts() + [f"a{c['op']}b mod {c['p']}", f"{c['epochs']} ep"]
                        + [f"{k} {v}" for k, v in self.distinct.items()])

    @property
    def slug(self) -> str:
        """A file-name-safe short name: arch[-preset][-L..-H..-d..-ff..]-op-pP-eE."""
        c = self.config
        parts = self._model_parts() + [{"+": "add", "-": "sub", "*": "mul", "/": "div"}.get(c["op"], "op"),
                                       f"p{c['p']}", f"e{c['epochs']}"] + [f"{k}{v}" for k, v in self.distinct.items()]
        return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(str(x) for x in parts)).strip("-").lower()

    @property
    def n_params(self) -> int | None:
        """The median parameter count the runs recorded (None if none did)."""
        values = sorted(r["result"]["n_params"] for r in self.runs if r["result"].get("n_params"))
        return int(values[len(values) // 2]) if values else None

    def arrays(self):
        lambdas = [float(r["config"]["weight_decay"]) for r in self.runs]
        regimes = [r["result"].get("regime") for r in self.runs]
        grokked = [g in GROKKED for g in regimes]
        t_grok = [float(r["result"]["t_grok_epoch"]) if r["result"].get("t_grok_epoch") is not None
                  and g else float("nan") for r, g in zip(self.runs, grokked)]
        return lambdas, regimes, grokked, t_grok


def load_groups(store: Store) -> tuple[list[Group], dict[str, int]]:
    """Done runs grouped by everything but λ, seed and device; plus the store's status counts."""
    groups: dict[tuple, Group] = {}
    for run in store.runs("done"):
        cfg = {k: v for k, v in run["config"].items() if k not in GROUP_EXCLUDE}
        key = tuple(sorted((k, repr(v)) for k, v in cfg.items()))
        groups.setdefault(key, Group(key=key, config=cfg)).runs.append(run)
    named = {"arch", "preset", "n_layers", "n_heads", "d_model", "d_ff", "op", "p", "epochs"}   # in the slug
    varying = sorted(k for k in {k for g in groups.values() for k in g.config} - named
                     if len({repr(g.config.get(k)) for g in groups.values()}) > 1)
    for g in groups.values():
        g.distinct = {k: g.config.get(k) for k in varying}
    ordered = sorted(groups.values(), key=lambda g: (g.config["arch"], g.n_params or 0, g.label))
    return ordered, store.counts()


def in_fit_range(lambdas, fit_max_lambda: float | None) -> list[bool]:
    """Which runs the λ_c and ν fits use (those with λ ≤ ``fit_max_lambda``; None: all)."""
    return [fit_max_lambda is None or lam <= fit_max_lambda for lam in lambdas]


def analyze_group(group: Group, n_boot: int = N_BOOT, seed: int = 0, fit_max_lambda: float | None = None) -> dict:
    """λ_c, ν (fixed and joint), regime table and median t_grok of one group, as a JSON-able dict.
    A fit that cannot be made is ``{"error": reason}``, never a number. Runs with λ above
    ``fit_max_lambda`` (e.g. the collapse regime, which the logistic would count as "not grokked")
    stay in the regime table but out of the fits."""
    lambdas, regimes, grokked, t_grok = group.arrays()
    n_zero = sum(1 for lam in lambdas if lam == 0)
    out: dict = {
        "group": group.label, "config": group.config, "n_runs": len(lambdas),
        "n_params": group.n_params, "n_zero_lambda": n_zero, "fit_max_lambda": fit_max_lambda,
        "notes": [],
    }
    if n_zero:
        out["notes"].append(f"{n_zero} run(s) at λ = 0 kept out of the λ_c fit (log-λ axis)")
    n_short = regimes.count("too-short")
    if n_short:
        out["notes"].append(f"{n_short} run(s) too short to classify (never fit the training set, stopped before "
                            f"epoch {NEVER_FIT_MIN_EPOCHS}): train longer (--epochs) to tell collapse from no-fit")
    in_fit = in_fit_range(lambdas, fit_max_lambda)
    if not all(in_fit):
        out["notes"].append(f"{in_fit.count(False)} run(s) with λ > {fit_max_lambda:g} kept out of the "
                            "λ_c and ν fits")
    fit_lambdas, fit_grokked, fit_t_grok = ([x for x, keep in zip(xs, in_fit) if keep]
                                            for xs in (lambdas, grokked, t_grok))
    try:
        fit = fit_lambda_c(fit_lambdas, fit_grokked, n_boot=n_boot, seed=seed, drop_zero=True)
        out["lambda_c"] = {"lambda_c": fit.lambda_c, "ci": list(fit.ci), "k": fit.k,
                           "n_boot_ok": fit.n_boot_ok, "n_boot": n_boot, "n_runs": fit.n_runs,
                           "bins": [list(b) for b in fit.bins]}
    except FitError as exc:
        out["lambda_c"] = {"error": str(exc)}
        fit = None
    for name, joint in (("nu", False), ("nu_joint", True)):
        if fit is None:
            out[name] = {"error": "nu: no λ_c (the λ_c fit failed, see above)"}
            continue
        try:
            nf = fit_nu(fit_lambdas, fit_t_grok, fit.lambda_c, n_boot=n_boot, seed=seed, joint=joint,
                                 grokked=fit_grokked)
            out[name] = {"nu": nf.nu, "ci": list(nf.ci), "amplitude": nf.amplitude, "n": nf.n,
                         "n_boot_ok": nf.n_boot_ok, "n_boot": n_boot, "lambda_c": nf.lambda_c}
        except FitError as exc:
            out[name] = {"error": str(exc)}
    table = regime_table(lambdas, regimes)
    medians = median_t_grok(lambdas, t_grok)
    out["regimes"] = [{"lambda": lam, **counts, "n": sum(counts.values()), "median_t_grok": medians.get(lam)}
                      for lam, counts in table.items()]
    return out
