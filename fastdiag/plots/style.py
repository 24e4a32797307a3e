"""The look of every figure (one rc style, regime markers and colours) and writing a figure: a
``Figure`` on the Agg canvas (no pyplot state), saved whole or not at all in each format."""
from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, Locator, MaxNLocator, NullFormatter

from fastdiag.store.files import atomic_path


REGIME_STYLE = {   # regime: (marker, colour, label)
    "grok": ("o", "#111111", "grok"),
    "anti-grok": ("^", "#8e44ad", "anti-grok"),
    "memorization": ("x", "#0072b2", "memorization"),
    "collapse": ("X", "#e69f00", "collapse"),
    "no-fit": ("D", "#999999", "no-fit"),
    "too-short": ("d", "#cccccc", "too short to classify"),
    "diverged": ("s", "#d55e00", "diverged"),
}

REGION_COLOURS = {"memorization": "#dce8f5", "developmental": "#e6f3fa", "collapse": "#fbeedb"}

STYLE = {
    "font.family": "serif",
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.labelsize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.25,
    "legend.frameon": False,
    "legend.fontsize": 9,
    "mathtext.fontset": "dejavuserif",
    "savefig.dpi": 150,
    "svg.fonttype": "none",          # SVG text stays text (searchable, editable)
}

FORMATS = ("png", "svg")


def figure(width: float, height: float, nrows: int = 1, ncols: int = 1, **kw):
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def save(fig, stem: Path, formats=FORMATS) -> list[Path]:
    paths = []
    with mpl.rc_context(STYLE):      # savefig.dpi, svg.fonttype and mathtext are read when the file is drawn
        for fmt in formats:
            path = stem.with_suffix(f".{fmt}")
            with atomic_path(path) as tmp:
                fig.savefig(tmp, format=fmt)
            paths.append(path)
    return paths


# --------------------------------------------------------------------------- readable log axes

def plain_number(x: float, _pos=None) -> str:
    """A tick label a reader takes in at once: 0.003, 2, 50, 1,000 (not 3×10⁻³, 2×10⁰)."""
    if not math.isfinite(x) or x <= 0:
        return ""
    if x >= 1:
        return f"{x:,.0f}" if abs(x - round(x)) < 1e-9 * x else f"{x:g}"
    return f"{x:.{max(0, -math.floor(math.log10(x)) + 1)}f}".rstrip("0").rstrip(".") if x >= 1e-6 else f"{x:.0e}"


def count_number(x: float, _pos=None) -> str:
    """A count (parameters) as 20k, 1M, 85M."""
    if not math.isfinite(x) or x <= 0:
        return ""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= factor:
            return f"{x / factor:g}{suffix}"
    return f"{x:g}"


class ReadableLogLocator(Locator):
    """Major ticks of a log axis that always label a short range: 1-2-5 per decade over up to 2.5
    decades (a 3-to-30-epoch run gets 5, 10, 20 instead of one "10"), 1 per decade beyond; every integer
    multiple when 1-2-5 leaves fewer than two ticks in view (three under about a decade: 1, 2, 3), and
    round linear steps (120, 125, 130) when even those leave fewer than two: every axis carries labels."""

    def __call__(self):
        vmin, vmax = self.axis.get_view_interval()
        return self.tick_values(vmin, vmax)

    def tick_values(self, vmin, vmax):
        vmin, vmax = sorted((vmin, vmax))
        if not (vmin > 0 and math.isfinite(vmax)):
            return np.array([])
        lo, hi = math.floor(math.log10(vmin)), math.ceil(math.log10(vmax))
        decades = math.log10(vmax / vmin)
        needed = 3 if decades < 1.2 else 2          # under about a decade: three labels, not one or two
        for subs in ((1,),) * (decades > 2.5) + ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
            ticks = np.array([m * 10.0 ** e for e in range(lo, hi + 1) for m in subs])
            if ((ticks >= vmin * (1 - 1e-9)) & (ticks <= vmax * (1 + 1e-9))).sum() >= needed:
                break
        if decades > 6:            # one tick every few decades on very wide axes
            ticks = ticks[np.isclose(np.log10(ticks) % math.ceil(decades / 6), 0)]
        in_view = ((ticks >= vmin * (1 - 1e-9)) & (ticks <= vmax * (1 + 1e-9))).sum()
        if in_view < 2:            # a view inside one integer step (t_grok 120 and 130): round linear steps
            linear = MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin, vmax)
            ticks = linear[linear > 0]
        return ticks


def readable_log_axis(axis, formatter=plain_number) -> None:
    """Log scale with plain-number labels at ``ReadableLogLocator``'s ticks (an ``ax.xaxis``/``ax.yaxis``)."""
    axis.axes.set_xscale("log") if axis is axis.axes.xaxis else axis.axes.set_yscale("log")
    axis.set_major_locator(ReadableLogLocator())
    axis.set_major_formatter(FuncFormatter(formatter))
    axis.set_minor_formatter(NullFormatter())


# --------------------------------------------------------------------------- text

_MATH_NAMES = [("λ_c", r"$\lambda_c$"), ("t_grok", r"$t_{\mathrm{grok}}$"), ("t_mem", r"$t_{\mathrm{mem}}$"),
               ("s̄", r"$\bar{s}$"), ("σ_H", r"$\sigma_H$"), ("t0", r"$t_0$")]


def mathify(text: str) -> str:
    """Names that the analysis writes in plain text (λ_c, t_grok, s̄, σ_H, ...) as the figure's
    rendered maths, so that a title mixing a reason and a formula reads one way; text already inside
    $...$ is left alone."""
    parts = re.split(r"(\$[^$]*\$)", str(text))
    for i in range(0, len(parts), 2):
        for plain, math_text in _MATH_NAMES:
            parts[i] = re.sub(rf"(?<![\w$]){re.escape(plain)}(?![\w])", lambda _m, m=math_text: m, parts[i])
    return "".join(parts)


def _shown(formula: str) -> str:
    """About what a mathtext formula shows: a command (\\lambda) is one character; braces, ^, _ and
    spaces none."""
    return re.sub(r"[{}^_ ]", "", re.sub(r"\\[A-Za-z]+", "x", formula))


def wrap(text: str, width: int = 90) -> str:
    """Lines of at most ``width`` visible characters (a $...$ formula counts as what it shows and is
    never split)."""
    words = re.findall(r"(?:\$[^$]*\$|\S)+", " ".join(str(text).split()))
    lines, line, shown = [], [], 0
    for word in words:
        size = len(re.sub(r"\$([^$]*)\$", lambda m: _shown(m.group(1)), word))
        if line and shown + 1 + size > width:
            lines.append(" ".join(line))
            line, shown = [], 0
        shown += size + (1 if line else 0)
        line.append(word)
    return "\n".join(lines + [" ".join(line)] if line else lines)


def fmt_lambda(x: float) -> str:
    return f"{x:.3g}"


def why(fit: dict) -> str:
    """The reason part of a FitError message, shortened for a title, its names in rendered maths."""
    msg = fit.get("error", "")
    return mathify(msg.split(": ", 1)[1] if ": " in msg else msg)


def no_data(ax, why: str) -> None:
    ax.text(0.5, 0.5, wrap(mathify(why), 40), transform=ax.transAxes, ha="center", va="center", color="#666666")


ARM_COLOURS = {"control": "#333333", "reinit": "#d55e00", "clip": "#0072b2"}

STAGE_COLOURS = {"coordination": "#009e73", "differentiation": "#f0e442", "re-synchronisation": "#d55e00",
                 "second differentiation": "#cc79a7", "collapse": "#555555"}
