"""The look of every figure (one rc style, regime markers and colours) and writing a figure: a
``Figure`` on the Agg canvas (no pyplot state), saved whole or not at all in each format."""
from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

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
    for fmt in formats:
        path = stem.with_suffix(f".{fmt}")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt)
        paths.append(path)
    return paths


def wrap(text: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(" ".join(str(text).split()), width))


def fmt_lambda(x: float) -> str:
    return f"{x:.3g}"


def why(fit: dict) -> str:
    """The reason part of a FitError message, shortened for a title."""
    msg = fit.get("error", "")
    return msg.split(": ", 1)[1] if ": " in msg else msg


def no_data(ax, why: str) -> None:
    ax.text(0.5, 0.5, wrap(why, 40), transform=ax.transAxes, ha="center", va="center", color="#666666")


ARM_COLOURS = {"control": "#333333", "reinit": "#d55e00", "clip": "#0072b2"}

STAGE_COLOURS = {"coordination": "#009e73", "differentiation": "#f0e442", "re-synchronisation": "#d55e00",
                 "second differentiation": "#cc79a7", "collapse": "#555555"}
