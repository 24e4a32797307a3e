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


@pytest.mark.parametrize("values", [(120, 130), (1000, 1100), (7, 8), (45, 47), (150, 150)])
def test_t_grok_axis_is_labelled_for_any_two_values(values):
    """The first small sweep a user runs: every t_grok inside one 1-2-5 step (120 and 130) left the log
    y axis without a single label; now round linear steps label it."""
    runs = [_run(lam, seed, values[seed % 2], epochs=max(values) + 5)[0] for lam in (0.3, 1.0, 3.0) for seed in range(2)]
    group = Group(key=(), config=CONFIG, runs=runs)
    fig = draw_t_grok(group, analyze_group(group, n_boot=20, seed=0))
    labels = visible_tick_labels(fig.axes[0].yaxis)
    assert len(labels) >= 2 and all(PLAIN.match(t) for t in labels), labels
    lo, hi = sorted(fig.axes[0].get_ylim())
    assert lo <= min(values) and max(values) <= hi


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


# ------------------------------------------------------------------------------ figures that say what they show

def test_wilson_interval_is_not_zero_at_zero_or_all_of_four():
    from fastdiag.analysis.binomial import wilson_interval

    lo, hi = wilson_interval(0, 4)
    assert lo == 0 and hi == pytest.approx(0.4899, abs=1e-4)          # 0 of 4 is not a certain 0
    assert wilson_interval(4, 4) == pytest.approx((1 - 0.4899, 1), abs=1e-4)
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    with pytest.raises(ValueError, match="k, n"):
        wilson_interval(5, 4)


def test_p_grok_error_bars_have_width_at_zero_and_one(short_sweep):
    group, analysis, _ = short_sweep
    fig = draw_p_grok(group, analysis, n_band=20)
    bars = [c for c in fig.axes[0].collections if isinstance(c, matplotlib.collections.LineCollection)]
    spans = [abs(seg[1][1] - seg[0][1]) for c in bars for seg in c.get_segments()]
    assert len(spans) == 7 and min(spans) > 0.3, spans        # 0/4 and 4/4 included: Wilson, not a zero s.e.
    assert any("Wilson" in t.get_text() for t in fig.legends[0].get_texts())


def test_groups_of_fewer_than_five_runs_are_drawn_run_by_run(short_sweep):
    group, _, traces = short_sweep
    fig = draw_trajectories(group, traces)
    lines = [line for line in fig.axes[0].get_lines() if len(line.get_xdata()) > 1]
    assert len(lines) == len(group.runs)                        # 4 seeds per λ: every run, no median
    assert "each run drawn" in " ".join(fig.get_suptitle().split())
    assert [a.get_ylabel() for a in fig.axes[:3]] == ["test accuracy", "$\\bar{s}(t)$", "$\\sigma_H(t)$ (nats)"]


def test_five_or_more_runs_get_a_median_that_stops_being_solid_when_runs_stop(short_sweep):
    group, _, traces = short_sweep
    runs = [dict(r, config=dict(r["config"], weight_decay=1.0)) for r in group.runs[:6]]
    for i, r in enumerate(runs):
        r["run_id"] = f"m{i}"
        traces[r["run_id"]] = [row for row in traces[group.runs[i]["run_id"]] if row["epoch"] <= 10 + 2 * i]
    fig = draw_trajectories(Group(key=(), config=CONFIG, runs=runs), traces)
    solid = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "-"]
    dotted = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == ":"]
    assert len(solid) == 1 and len(dotted) == 1
    xs, ys = solid[0].get_xdata(), solid[0].get_ydata()
    assert max(x for x, y in zip(xs, ys) if not math.isnan(y)) == 10      # all six runs reach epoch 10 only


def test_regime_diagram_says_its_points_are_jittered(short_sweep):
    group, analysis, _ = short_sweep
    fig = draw_regime_diagram([group], [analysis])
    assert "jittered" in fig.axes[0].get_title()


def test_stages_title_reads_the_current_label_not_the_stored_one(tmp_path):
    from fastdiag.plots.render import _stages_for_group

    # grokked, one evaluation below 0.5 much later, recovered: the old rule stored anti-grok; today's says grok
    trace = [{"epoch": e, "train_acc": 1.0 if e >= 10 else 0.5, "test_acc": 0.3 if e == 3000 else (1.0 if e >= 50 else 0.1),
              "s_bar": 0.9 + 0.05 * math.sin(math.log(e) * 3), "sigma_h": 0.05 + 0.04 * math.cos(math.log(e) * 3)}
             for e in range(10, 10010, 10)]
    run = {"run_id": "x", "config": {**CONFIG, "weight_decay": 1.0, "seed": 0, "epochs": 10000, "stop_at_grok": False},
           "result": {"regime": "anti-grok", "t_grok_epoch": 50}}
    group = Group(key=(), config={**CONFIG, "stop_at_grok": False}, runs=[run])
    paths = _stages_for_group(group, {"x": trace}, lambda base: tmp_path / base, ("png",))
    assert paths, "no stages found in the synthetic trace"
    import fastdiag.plots.render as render
    seen = []
    original = render.stages_figure
    render.stages_figure = lambda trace, seg, stem, title="", formats=(): seen.append(title) or []
    try:
        _stages_for_group(group, {"x": trace}, lambda base: tmp_path / base, ("png",))
    finally:
        render.stages_figure = original
    assert seen and "(grok by today's rules; stored as anti-grok)" in seen[0], seen


def test_intervention_arms_are_not_joined_and_every_seed_shows(tmp_path):
    from fastdiag.plots.experiments import intervention_figure

    rows, traces = [], {}
    for seed in range(4):
        for arm, peak in (("control", 0.02), ("reinit", 0.1), ("clip", 0.0 if seed % 2 else 0.05)):   # a split arm
            rid = f"{arm}{seed}"
            rows.append({"arm": arm, "seed": seed, "arm_id": rid, "branch_epoch": 100,
                         "metrics": {"peak_sigma_h_after": peak + 0.001 * seed}})
            traces[rid] = [{"epoch": 100 + e, "sigma_h": peak + 0.001 * e} for e in range(0, 50, 5)]
    import matplotlib.figure
    saved = {}
    original = matplotlib.figure.Figure.savefig
    matplotlib.figure.Figure.savefig = lambda self, *a, **k: saved.setdefault("fig", self)
    try:
        intervention_figure(rows, traces, tmp_path / "iv", formats=("png",))
    finally:
        matplotlib.figure.Figure.savefig = original
    right = saved["fig"].axes[1]
    for line in right.get_lines():                               # only the median bars: flat, inside one arm
        xs, ys = line.get_xdata(), line.get_ydata()
        assert len(set(ys)) == 1 and max(xs) - min(xs) < 1, (xs, ys)
    dots = sorted(float(y) for c in right.collections for _, y in c.get_offsets())
    assert len(dots) == 12 and dots[0] < 0.01 and 0.04 < sorted(d for d in dots if d < 0.06)[-1]   # both clip modes


def test_the_run_figure_says_what_its_peak_sigma_h_is():
    trace = [{"epoch": e, "train_acc": min(1, e / 20), "test_acc": 1.0 if e >= 40 else 0.1, "s_bar": 0.9,
              "sigma_h": 0.07 if e == 6 else 0.02 + (0.01 if e == 60 else 0)} for e in range(2, 80, 2)]
    fig = draw_trajectory(trace, {"t_grok_epoch": 40, "t_mem_epoch": 20})
    labels = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert "largest σ_H 0.070 (epoch 6)" in labels
    assert "largest from t_grok on (Phase 2) 0.030 (epoch 60)" in labels
    stopped = draw_trajectory([r for r in trace if r["epoch"] <= 40], {"t_grok_epoch": 40, "t_mem_epoch": 20})
    labels = [t.get_text() for t in stopped.axes[2].get_legend().get_texts()]      # stopped at t_grok: no Phase 2
    assert "largest σ_H 0.070 (epoch 6)" in labels and not any("Phase 2" in label for label in labels)
