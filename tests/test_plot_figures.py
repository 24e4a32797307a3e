"""Figures a reader understands at a glance (issue 31): readable plain tick labels on short log axes,
legends off the data, titles that fit, one way of writing λ_c / t_grok, the seed lists analyze prints,
and no "measurably" verdict from a bootstrap interval of zero width. The tests read the Figure objects."""
import math
import re

import matplotlib
import pytest

from fastdiag.analysis.groups import Group, analyze_group
from fastdiag.analysis.predict import TOO_SMALL, _verdict, predictive_analysis, seed_list
from fastdiag.cli.analyze import format_predict
from fastdiag.plots.experiments import draw_predict, draw_stages
from fastdiag.plots.run import draw_trajectory
from fastdiag.plots.style import ReadableLogLocator, mathify, plain_number, wrap
from fastdiag.plots.sweep import draw_p_grok, draw_regime_diagram, draw_t_grok, draw_trajectories

PLAIN = re.compile(r"^[0-9][0-9,]*(\.[0-9]+)?$")           # 0.05, 2, 1,000 — no 2×10^0, no 10^1
CONFIG = dict(arch="transformer", preset="custom", n_layers=1, n_heads=2, d_model=16, d_ff=32, op="+", p=11,
              epochs=30, stop_at_grok=True)


def visible_tick_labels(axis) -> list[str]:
    """The major tick labels a reader sees: ticks inside the view, through the axis's own formatter."""
    axis.axes.figure.canvas.draw()
    lo, hi = sorted(axis.get_view_interval())
    fmt = axis.get_major_formatter()
    return [fmt(x) for x in axis.get_majorticklocs() if lo * (1 - 1e-9) <= x <= hi * (1 + 1e-9)]


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def raw_names_outside_maths(fig) -> list[str]:
    """Texts of ``fig`` that spell λ_c, t_grok or t_mem in plain text (outside $...$)."""
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    return [t for t in texts if re.search(r"λ_c|t_grok|t_mem", re.sub(r"\$[^$]*\$", "", t))]


def _run(lam, seed, t_grok, epochs=30, n_params=5000):
    trace = [{"epoch": e, "step": 3 * e, "train_acc": min(1.0, e / 5), "test_acc": 1.0 if t_grok and e >= t_grok else 0.05,
              "s_bar": 0.95 - 0.001 * e * lam, "sigma_h": 0.05 + 0.0005 * e * (seed + 1),
              "train_loss": 2.0 / e, "test_loss": 3.0 / e + 0.1 * seed, "weight_norm": 30.0 - lam * e / 10}
             for e in range(3, epochs + 1)]
    return ({"run_id": f"r{lam}-{seed}", "config": {**CONFIG, "epochs": epochs, "weight_decay": lam, "seed": seed},
             "result": {"regime": "grok" if t_grok else "memorization", "t_grok_epoch": t_grok, "t_mem_epoch": 5,
                        "n_params": n_params}}, trace)


@pytest.fixture(scope="module")
def short_sweep():
    """A 30-epoch sweep (evaluations from epoch 3): λ_c near 0.05, t_grok 2-20 epochs."""
    runs, traces = [], {}
    for lam in (0.01, 0.02, 0.05, 0.1, 0.3, 1.0, 3.0):
        for seed in range(4):
            grokked = seed < {0.01: 0, 0.02: 1, 0.05: 2, 0.1: 3}.get(lam, 4)      # a graded transition
            run, trace = _run(lam, seed, max(3, round(4 * lam ** -0.5 + seed)) if grokked else None)
            runs.append(run)
            traces[run["run_id"]] = trace
    group = Group(key=(), config=CONFIG, runs=runs)
    return group, analyze_group(group, n_boot=60, seed=0), traces


# ------------------------------------------------------------------------------ ticks

@pytest.mark.parametrize("lo,hi,expected", [(1, 3, [1, 2, 3]), (3, 30, [5, 10, 20]), (0.01, 3, [0.01, 0.02, 0.05, 0.1,
                                                                                                  0.2, 0.5, 1, 2])])
def test_the_log_locator_labels_a_short_range_with_several_ticks(lo, hi, expected):
    ticks = [t for t in ReadableLogLocator().tick_values(lo, hi) if lo <= t <= hi]
    assert ticks == pytest.approx(expected)
    assert [plain_number(t) for t in (0.003, 2, 20, 1000, 20000)] == ["0.003", "2", "20", "1,000", "20,000"]


def test_a_short_run_on_a_log_epoch_axis_shows_several_plain_epoch_labels(short_sweep):
    group, _, traces = short_sweep
    fig = draw_trajectories(group, traces)
    labels = visible_tick_labels(fig.axes[-1].xaxis)
    assert labels == ["5", "10", "20"]                  # was one "10^1" for epochs 3-30
    run_fig = draw_trajectory([{"epoch": e, "train_acc": 0.1, "test_acc": 0.05, "s_bar": 0.98, "sigma_h": 0.01}
                               for e in (1, 2, 3)])
    assert visible_tick_labels(run_fig.axes[-1].xaxis) == ["1", "2", "3"]      # `fastdiag run --epochs 3`
    stages = draw_stages(traces["r1.0-0"], {"stages": [{"stage": "coordination", "start_epoch": 3, "end_epoch": 10}]})
    assert all(PLAIN.match(t) for t in visible_tick_labels(stages.axes[-1].xaxis))


def test_t_grok_figure_has_plain_tick_labels_and_its_legend_below_the_data(short_sweep):
    group, analysis, _ = short_sweep
    assert "nu" in analysis["nu"], analysis["nu"]
    fig = draw_t_grok(group, analysis)
    ax = fig.axes[0]
    for axis in (ax.xaxis, ax.yaxis):
        labels = visible_tick_labels(axis)
        assert len(labels) >= 3 and all(PLAIN.match(t) for t in labels), labels     # was 2×10^0, 3×10^0 ...
    legend = fig.legends[0]
    renderer = fig.canvas.get_renderer()
    assert not overlaps(legend.get_window_extent(renderer), ax.get_window_extent(renderer))
    n_above = sum(1 for r in group.runs if r["result"]["t_grok_epoch"]
                  and r["config"]["weight_decay"] > analysis["lambda_c"]["lambda_c"])
    assert [t.get_text() for t in legend.get_texts()][0] == f"grokked runs ({n_above})"


def test_without_a_fit_the_figures_write_lambda_c_as_maths_not_raw_text(short_sweep):
    group, analysis, _ = short_sweep
    failed = {**analysis, "lambda_c": {"error": "lambda_c: the λ_c fit failed for a reason"},
              "nu": {"error": "nu: no λ_c (the λ_c fit failed, see above)"}, "nu_joint": {"error": "nu: no λ_c"}}
    for fig in (draw_t_grok(group, failed), draw_p_grok(group, failed, n_band=20),
                draw_regime_diagram([group], [failed])):
        assert raw_names_outside_maths(fig) == []
    legend = draw_t_grok(group, failed).legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["grokked runs (18)"]     # not "(against λ: no λ_c)"
    assert mathify("no λ_c; t_grok, $\\lambda_c$") == "no $\\lambda_c$; $t_{\\mathrm{grok}}$, $\\lambda_c$"
    assert wrap("a $\\lambda - \\lambda_c$ b", 5) == "a\n$\\lambda - \\lambda_c$\nb"    # a formula is never split


# ------------------------------------------------------------------------------ the predictive test

@pytest.fixture(scope="module")
def predict_sweep():
    runs, traces = [], {}
    for seed in range(6):
        for lam in (0.02, 0.05, 0.1, 0.3):
            grokked = lam >= 0.1 or (lam == 0.05 and seed % 2 == 0)
            run, trace = _run(lam, seed, 8 + 3 * seed + round(2 / lam) % 7 if grokked else None)
            runs.append(run)
            traces[run["run_id"]] = trace
    return predictive_analysis(runs, traces, t0=6, n_boot=100, seed=0)


def test_predict_figure_titles_fit_legends_are_off_the_data_and_seeds_are_listed_as_analyze_prints(predict_sweep):
    pa = predict_sweep
    assert pa.groks_by_horizon.auc_full is not None and pa.log_t_grok.mae_full is not None, pa
    fig = draw_predict(pa)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        assert page.x0 <= title.x0 and title.x1 <= page.x1, ax.title.get_text()        # not clipped
        legend = ax.get_legend()
        assert legend is not None and not overlaps(legend.get_window_extent(renderer), ax.get_window_extent(renderer))
    suptitle = fig._suptitle.get_text()
    text = "\n".join(format_predict(pa))
    for seeds in (pa.train_seeds, pa.test_seeds):
        listed = seed_list(seeds)
        assert listed in " ".join(suptitle.split()) and listed in text                 # was "test seeds 3" vs [1, 4, 5]
    assert raw_names_outside_maths(fig) == []


def test_a_zero_width_interval_says_the_sample_is_too_small_not_measurably_worse():
    assert _verdict((-0.5, -0.5), better_if_positive=True) == TOO_SMALL      # was "measurably worse"
    assert _verdict((0.0, 0.0), better_if_positive=True) == TOO_SMALL
    assert _verdict((-0.3, -0.1), better_if_positive=True) == "is measurably worse than the baselines alone"
    assert _verdict((-0.1, 0.2), better_if_positive=False) == "adds no measurable value"
    # --predict on 4 runs: 2 seeds, one held out with one grokked and one non-grokked run
    runs, traces = [], {}
    for seed in (0, 1):
        for lam, t_grok in ((0.02, None), (0.3, 12 + seed)):
            run, trace = _run(lam, seed, t_grok)
            runs.append(run)
            traces[run["run_id"]] = trace
    pa = predictive_analysis(runs, traces, t0=6, n_boot=200, seed=0)
    cls = pa.groks_by_horizon
    assert cls.test_positives == 1 and cls.test_negatives == 1
    assert cls.diff_ci[0] == cls.diff_ci[1] and cls.verdict == TOO_SMALL
    text = "\n".join(format_predict(pa))
    assert "sample is too small" in text and "measurably" not in text
