"""PNG plots of a report's per-machine table (matplotlib, headless Agg backend).

Per machine (GPU type or host), three figures: output throughput vs DDTree budget (one
line per top-k, a column per temperature, a row per concurrency, AR and DFlash as
dashed reference lines), acceptance length vs budget, and the speedup over AR as a
budget x top-k heatmap. Eager-mode cells are drawn hollow with an "eager" note (and
starred in the heatmap) because their numbers are not comparable with graph mode.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist

from ddtree_ops.errors import ConfigError

#: Inches per panel; a figure has a column per temperature and a row per concurrency.
_PANEL_W, _PANEL_H = 4.6, 3.4


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "machine"


def _grid(frame: pd.DataFrame) -> tuple[list[float], list[int]]:
    """The temperatures (panel columns) and concurrencies (panel rows) of ``frame``."""
    temperatures = sorted(frame["temperature"].dropna().unique())
    return temperatures, sorted(int(conc) for conc in frame["concurrency"].dropna().unique())


def _panels(
    axes: np.ndarray, frame: pd.DataFrame, temps: list[float], concs: list[int]
) -> Iterator[tuple[plt.Axes, pd.DataFrame]]:
    """Each panel's axes (titled) with the rows of ``frame`` it shows."""
    for row, conc in enumerate(concs):
        for col, temp in enumerate(temps):
            ax = axes[row][col]
            ax.set_title(f"temperature {temp:g}, concurrency {conc}", fontsize=10)
            yield ax, frame[(frame["temperature"] == temp) & (frame["concurrency"] == conc)]


def _figure(rows: int, cols: int, title: str) -> tuple[plt.Figure, np.ndarray]:
    width = _PANEL_W * cols + 0.8
    fig, axes = plt.subplots(
        rows, cols, figsize=(width, _PANEL_H * rows + 1.4), squeeze=False, layout="constrained"
    )
    # Long GPU names would run off a narrow figure: wrap at about 8 bold characters per inch.
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(width * 8))), fontsize=13, fontweight="bold")
    return fig, axes


def _line_plot(
    data: pd.DataFrame, machine: str, value: str, ylabel: str, title: str, path: Path, *, baselines: bool
) -> Path | None:
    trees = data[data["algorithm"] == "DDTREE"]
    if trees.empty or trees[value].notna().sum() == 0:
        return None
    temps, concs = _grid(data)
    fig, axes = _figure(len(concs), len(temps), f"{machine} — {title}")
    topks = sorted(int(k) for k in trees["topk"].dropna().unique())
    colors = {k: plt.cm.viridis(i / max(1, len(topks) - 1) * 0.85) for i, k in enumerate(topks)}
    budgets = sorted(int(b) for b in trees["budget"].dropna().unique())
    for ax, panel in _panels(axes, data, temps, concs):
        tree_panel = panel[panel["algorithm"] == "DDTREE"]
        for k in topks:
            line = tree_panel[tree_panel["topk"] == k].sort_values("budget")
            if line.empty:
                continue
            ax.plot(line["budget"].astype(float), line[value], "-", color=colors[k], lw=1.8, label=f"top-k {k}")
            # Graph-mode points filled, eager ones hollow diamonds: not comparable numbers.
            for graph, marker_face in ((True, colors[k]), (False, "white")):
                pts = line[line["cuda_graph"] == graph]
                ax.scatter(pts["budget"].astype(float), pts[value], s=38, zorder=3, facecolors=marker_face,
                           edgecolors=colors[k], linewidths=1.6, marker="o" if graph else "D")
        if baselines:
            for algo, style, name in (("AR", ":", "autoregressive"), ("DFLASH", "--", "DFlash")):
                base = panel[panel["algorithm"] == algo]
                if not base.empty and base[value].notna().any():
                    level = float(base[value].max())
                    ax.axhline(level, color="0.35", ls=style, lw=1.2, label=f"{name} ({level:,.0f})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("DDTree budget (nodes)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    # One legend for all panels, below them, so that no curve is hidden behind it; a
    # baseline's label names its level per panel, the legend keeps the name only.
    handles: dict[str, Artist] = {}
    for ax in axes.ravel():
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label.split(" (")[0], handle)
    if (~trees["cuda_graph"]).any():
        handles["hollow diamond = eager mode (no CUDA graph)"] = plt.Line2D(
            [], [], ls="", marker="D", markerfacecolor="white", markeredgecolor="0.2"
        )
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=min(6, len(handles)), fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _heatmap(data: pd.DataFrame, machine: str, path: Path) -> Path | None:
    trees = data[(data["algorithm"] == "DDTREE") & data["speedup_vs_ar"].notna()]
    if trees.empty:
        return None
    temps, concs = _grid(trees)
    budgets = sorted(int(b) for b in trees["budget"].dropna().unique())
    topks = sorted(int(k) for k in trees["topk"].dropna().unique())
    fig, axes = _figure(len(concs), len(temps), f"{machine} — DDTree speedup over autoregressive (x)")
    vmax = float(trees["speedup_vs_ar"].max())
    vmin = min(1.0, float(trees["speedup_vs_ar"].min()))
    image = None
    for ax, panel in _panels(axes, trees, temps, concs):
        grid = np.full((len(topks), len(budgets)), np.nan)
        eager = np.zeros_like(grid, dtype=bool)
        for _, row in panel.iterrows():
            i, j = topks.index(int(row["topk"])), budgets.index(int(row["budget"]))
            # Several rows per cell only with graph+eager both present: keep graph.
            if np.isnan(grid[i, j]) or row["cuda_graph"]:
                grid[i, j] = row["speedup_vs_ar"]
                eager[i, j] = not row["cuda_graph"]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
        for i in range(len(topks)):
            for j in range(len(budgets)):
                if not np.isnan(grid[i, j]):
                    text = f"{grid[i, j]:.2f}{'*' if eager[i, j] else ''}"
                    ax.text(j, i, text, ha="center", va="center", fontsize=8.5)
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_yticks(range(len(topks)), [str(k) for k in topks])
        ax.set_xlabel("DDTree budget (nodes)")
        ax.set_ylabel("DDTree top-k")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="speedup vs autoregressive (x)")
    if (~trees["cuda_graph"]).any():
        fig.suptitle(f"{machine} — DDTree speedup over autoregressive (x)\n"
                     "* = eager mode (no CUDA graph): not comparable with unstarred cells",
                     fontsize=12, fontweight="bold")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(grouped: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Write the three figures per machine of ``grouped`` into ``out_dir``; return paths."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{out_dir}: cannot create the plot folder: {exc.strerror or exc}") from exc
    written: list[Path] = []
    for machine, data in grouped.groupby("machine", sort=True):
        slug = _slug(str(machine))
        for maybe in (
            _line_plot(data, str(machine), "output_tok_s_median", "output throughput (tokens/s, median)",
                       "throughput vs DDTree budget", out_dir / f"{slug}-throughput.png", baselines=True),
            _line_plot(data, str(machine), "accept_length_median", "acceptance length (tokens / verify step)",
                       "acceptance length vs DDTree budget", out_dir / f"{slug}-accept-length.png", baselines=False),
            _heatmap(data, str(machine), out_dir / f"{slug}-speedup-heatmap.png"),
        ):
            if maybe is not None:
                written.append(maybe)
    return written
