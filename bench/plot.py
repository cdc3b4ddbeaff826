"""The benches' figures as one PNG beside their text tables (`--plot PATH`).

Each bench turns its results into `Panel`s (grouped bars: categories along the x axis,
one bar per series, an optional label over each group such as a ratio) and calls `save`.
matplotlib is imported only here and only when a figure is asked for: it is the `bench`
extra (`pip install -e '.[bench]'`), never a dependency of quilld. The PNG is written
with a small palette, a few tens of KB, fit to commit (docs/img/).
"""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass, field
from pathlib import Path

# One colour per series, in order. The benches put the reference (redis-server, redis-py, the
# raw disk, Mooncake Store) first, in orange, and quilld's own figure second, in blue.
COLORS = ("#e07b24", "#1f6fb4", "#3a9a4a", "#b7413e", "#7d5ba6", "#8c6d31")


@dataclass
class Panel:
    title: str
    categories: list[str]
    series: dict[str, list[float]]  # series name -> one value per category
    ylabel: str
    labels: list[str] = field(default_factory=list)  # over each category's group, e.g. "1.38x"
    logy: bool = False
    bar_colors: list[str] = field(default_factory=list)  # one series: a colour per category; else per series


RAW, QUILLD = COLORS[0], COLORS[1]  # single-series panels: the reference (raw disk, ...) and quilld's own


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", metavar="PATH", help="also write the figures as a PNG to PATH "
                        "(needs matplotlib: pip install -e '.[bench]')")


def save(path: str | Path, panels: list[Panel], title: str, note: str = "") -> Path:
    """Draw `panels` side by side (two per row) under `title`, `note` in small print below."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(panels), 2)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.9 * rows + (0.35 if note else 0)), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _bars(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=12)
    if note:
        fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=7.5, color="#555555", wrap=True)
    fig.tight_layout(rect=(0, 0.05 if note else 0, 1, 0.95))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_small(buf.getvalue(), out)
    print(f"figure written to {out} ({out.stat().st_size // 1024} KiB)")
    return out


def _bars(ax, p: Panel) -> None:
    n = len(p.series)
    width = 0.8 / max(n, 1)
    xs = range(len(p.categories))
    tops = [0.0] * len(p.categories)
    for i, (name, values) in enumerate(p.series.items()):
        if len(values) != len(p.categories):
            raise ValueError(f"{p.title}: series {name!r} has {len(values)} values for {len(p.categories)} categories")
        pos = [x - 0.4 + width * (i + 0.5) for x in xs]
        if p.bar_colors:
            color = p.bar_colors if n == 1 else p.bar_colors[i]
        else:  # a lone series is quilld's own figure
            color = COLORS[1] if n == 1 else COLORS[i % len(COLORS)]
        ax.bar(pos, values, width * 0.92, label=name, color=color)
        tops = [max(t, v) for t, v in zip(tops, values)]
    if p.logy:
        ax.set_yscale("log")
    ax.set_xticks(list(xs), p.categories, fontsize=8.5)
    ax.set_ylabel(p.ylabel, fontsize=9)
    ax.set_title(p.title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if n > 1:
        ax.legend(fontsize=7.5, frameon=False)
    if p.labels:
        high = max(tops) if tops else 1.0
        for x, top, text in zip(xs, tops, p.labels):
            ax.annotate(text, (x, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8, fontweight="bold")
        if not p.logy:
            ax.set_ylim(0, high * 1.18)
        else:
            ax.set_ylim(top=high * 2.5)


def _write_small(png: bytes, out: Path) -> None:
    """Re-encode with a 64-colour palette (flat bars and text lose nothing): a few tens of KB."""
    try:
        from PIL import Image  # matplotlib depends on Pillow
    except ImportError:
        out.write_bytes(png)
        return
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)


def ratio(a: float, b: float) -> str:
    """`a / b` as a label: "1.38x"."""
    return f"{a / b:.2f}x" if b else "-"
