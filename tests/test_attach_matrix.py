"""The attach matrix: real Hugging Face architectures from tiny random configs (nothing downloaded),
eager and sdpa, padded and unpadded, each against float64 statistics of the probabilities the model
really used (its eager twin's ``output_attentions``, same weights), padding rows left out (docs/attach.md, "Padding").
Outputs and gradients must be unchanged by attach.

``python tests/test_attach_matrix.py`` prints the table shown in docs/attach.md.
"""
from __future__ import annotations

import sys

import pytest
import torch

import fastdiag

transformers = pytest.importorskip("transformers")

if __name__ == "__main__":       # `python tests/test_attach_matrix.py`: the repository root on the path
    sys.path.insert(0, ".")
from tests.hf_matrix import ARCHS, TOL, attach_changes, build, inputs, model_output, reference  # noqa: E402


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def measure(arch: str, impl: str, padded: bool):
    """Runs one matrix row; returns (row dict for the table, problems list)."""
    try:
        model = build(arch, impl)
    except ValueError as err:  # transformers refuses: "does not support an attention implementation ..."
        if "does not support" not in str(err):
            raise
        model = None
    if model is None or model.config._attn_implementation != impl:
        return None, [f"{arch}: attn_implementation {impl!r} not available in transformers {transformers.__version__}"]
    batch = inputs(arch, padded)
    monitor, problems, changes = attach_changes(model, lambda m: model_output(m(**batch)))
    problems += changes
    stats = monitor.latest_stats()
    ref = reference(arch, model, batch)
    if stats is None or len(stats) != len(ref):
        problems.append(f"{0 if stats is None else len(stats)} layers measured, {len(ref)} in the model")
        return None, problems
    got_sum, want_sum = fastdiag.summarize(stats), fastdiag.summarize(ref)
    errors = {"s̄": _rel(got_sum.s_bar.item(), want_sum.s_bar.item()),
              "σ_H": _rel(got_sum.sigma_h.item(), want_sum.sigma_h.item()),
              "per layer": max(max(_rel(g.sync().item(), w.sync().item()),
                               _rel(g.entropy_spread().item(), w.entropy_spread().item()))
                           for g, w in zip(stats.values(), ref))}
    if any(not torch.equal(g.rows.double(), w.rows.double()) for g, w in zip(stats.values(), ref)):
        problems.append("counted query rows differ from the padding convention")
    short = {text: key for key, text in fastdiag.core.monitor.HOW.items()}
    hows = sorted({short[text] for text in monitor.coverage()["measured"].values()})
    row = dict(arch=arch, impl=impl, padded=padded, how="; ".join(hows), layers=len(ref),
               sigma_h=want_sum.sigma_h.item(), errors=errors)
    problems += [f"{k} relative error {v:.2e} > {TOL}" for k, v in errors.items() if v > TOL]
    return row, problems


NO_SDPA = ["gemma2 (softcap 5, window 4)", "bloom (alibi)", "gpt_oss (attention sinks, window 4)",
           "deberta-v2 (disentangled relative attention)", "mpt (alibi)",
           "markuplm (finite mask -1e4)"]  # transformers has no sdpa path for them
CASES = [(arch, impl, padded) for arch in ARCHS for impl in ("eager", "sdpa") for padded in (False, True)
         if not (padded and ARCHS[arch][2] == "vision") and not (impl == "sdpa" and arch in NO_SDPA)]


@pytest.mark.parametrize("arch,impl,padded", CASES,
                         ids=[f"{a.split()[0]}-{i}-{'padded' if p else 'full'}" for a, i, p in CASES])
def test_matrix(arch, impl, padded):
    row, problems = measure(arch, impl, padded)
    assert not problems, problems


@pytest.mark.parametrize("arch", NO_SDPA)
def test_architectures_without_sdpa_are_refused_by_transformers(arch):
    """Their sdpa rows are left out of the matrix because transformers cannot build them; once it
    can, this fails and the rows belong in the matrix."""
    row, problems = measure(arch, "sdpa", padded=False)
    assert row is None and "not available" in problems[0]


@pytest.mark.parametrize("arch", ["gpt2", "llama (GQA)", "bert", "bart"])
def test_eager_and_sdpa_agree_on_a_padded_batch(arch):
    """The same batch gives the same statistics through the eager and the SDPA path
    (left-padded rows that eager masks with finfo.min included)."""
    batch = inputs(arch, padded=True)
    results = {}
    for impl in ("eager", "sdpa"):
        model = build(arch, impl)
        with fastdiag.attach(model, every=1) as monitor:
            model(**batch)
        results[impl] = monitor.latest()
    for key, value in results["eager"].items():
        if key not in ("step", "mode"):
            assert _rel(results["sdpa"][key], value) <= TOL, key


def table() -> str:
    lines = ["| model | impl | padded | how measured | layers | σ_H | rel. err s̄ | rel. err σ_H | max rel. err per layer | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arch, impl, padded in sorted(CASES + [(a, "sdpa", p) for a in NO_SDPA for p in (False, True)],
                                     key=lambda case: (list(ARCHS).index(case[0]), case[1], case[2])):
        row, problems = measure(arch, impl, padded)
        if row is None:
            lines.append(f"| {arch} | {impl} | {'yes' if padded else 'no'} | — | | | | | | {'; '.join(problems)} |")
            continue
        verdict = "ok" if not problems else "; ".join(problems)
        err = row["errors"]
        lines.append(f"| {arch} | {impl} | {'yes' if padded else 'no'} | {row['how']} | {row['layers']} | "
                     f"{row['sigma_h']:.3g} | {err['s̄']:.1e} | {err['σ_H']:.1e} | {err['per layer']:.1e} | {verdict} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
