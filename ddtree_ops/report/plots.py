"""PNG plots of a report's per-machine table (matplotlib, headless Agg backend).

Per machine (GPU type or host; per run too where a machine holds cells of several runs,
report.runs), four figures: output throughput vs DDTree budget (one
line per top-k, a column per temperature, a row per concurrency, AR and DFlash as
dashed reference lines), acceptance length vs budget, the speedup over AR as a
budget x top-k heatmap, and a Pareto plot of throughput per GPU against throughput per
user over every configuration and concurrency. Eager-mode cells never share a line with
graph-mode ones (dashed lines, hollow markers, legend entries of their own; starred in
the heatmap) because their numbers are not comparable.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.figure import Figure

from ddtree_ops.errors import ConfigError
from ddtree_ops.fsutil import replace_file, write_problem

#: Inches per panel; a figure has a column per temperature and a row per concurrency.
_PANEL_W, _PANEL_H = 4.6, 3.4


# A machine's name (a ledger's gpu_name or host) prefixes four file names: kept well under
# a file name's 255 bytes, however long the name in the ledger.
_SLUG_MAX = 60


def _slug(text: str) -> str:
    """A file-name part for ``text``: lower-case letters, digits and dashes. A name cut to
    fit, or one that only spells alike after cleaning, ends in a hash of the whole name."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "machine"
    if len(slug) > _SLUG_MAX:
        slug = f"{slug[:_SLUG_MAX].rstrip('-')}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    return slug


def _save(fig: Figure, path: Path, *, dpi: int) -> None:
    """``fig`` as the PNG ``path``, replaced atomically (a link planted at the name is
    replaced, never written through; a full disk leaves no half image): one line if not."""
    try:
        replace_file(path, lambda fh: fig.savefig(fh, dpi=dpi, format="png"))
    except OSError as exc:
        plt.close(fig)
        raise ConfigError(f"{path}: cannot write the plot: {write_problem(exc)}") from None


def _slugs(names: list[str]) -> dict[str, str]:
    """One distinct slug per name: names that clean to the same text get their hash too."""
    plain = {name: _slug(name) for name in names}
    taken = Counter(plain.values())
    return {
        name: slug if taken[slug] == 1 else f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
        for name, slug in plain.items()
    }


def _label_colour(rgba: Sequence[float]) -> str:
    """Black or white, whichever reads better on ``rgba`` (WCAG relative luminance)."""

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgba[:3])
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # Contrast with white (1.05 / (L + 0.05)) beats contrast with black ((L + 0.05) / 0.05)
    # below L = 0.179.
    return "white" if luminance < 0.179 else "black"


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
            # Graph-mode and eager points never share a line: their numbers are not
            # comparable (eager: dashed, hollow diamonds, a legend entry of its own).
            for graph, style, marker_face, label in ((True, "-", colors[k], f"top-k {k}"),
                                                     (False, "--", "white", f"top-k {k}, eager")):
                pts = line[line["cuda_graph"] == graph]
                if pts.empty:
                    continue
                ax.plot(pts["budget"].astype(float), pts[value], style, color=colors[k], lw=1.8, label=label,
                        marker="o" if graph else "D", markersize=6, markerfacecolor=marker_face,
                        markeredgecolor=colors[k], markeredgewidth=1.6)
        if baselines:
            chains = panel[(panel["algorithm"] == "DFLASH") & panel["budget"].notna() & panel[value].notna()]
            chains = chains.sort_values("budget")
            if not chains.empty:
                # A chain of n draft tokens verifies what a tree of n - 1 nodes does: drawn
                # at that budget, so each tree point stands above or below its own chain.
                ax.plot(chains["budget"].astype(float) - 1, chains[value], "--", color="0.35", lw=1.2, marker="s",
                        markersize=4, label="DFlash chain, same verify width")
            for algo, style, name in (("AR", ":", "autoregressive"), ("DFLASH", "--", "DFlash")):
                base = panel[(panel["algorithm"] == algo) & panel["budget"].isna()]
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
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=min(6, len(handles)), fontsize=9)
    _save(fig, path, dpi=110)
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
                    colour = _label_colour(tuple(image.cmap(image.norm(grid[i, j]))))
                    ax.text(j, i, text, ha="center", va="center", fontsize=8.5, color=colour)
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
    _save(fig, path, dpi=110)
    plt.close(fig)
    return path


_ALGO_COLORS = {"AR": "0.45", "DFLASH": "tab:orange", "DDTREE": "tab:blue"}


def _label(row: pd.Series) -> str:
    if row["algorithm"] == "DDTREE":
        return f"b{int(row['budget'])}k{int(row['topk'])} c{int(row['concurrency'])}"
    return f"{'AR' if row['algorithm'] == 'AR' else 'DFlash'} c{int(row['concurrency'])}"


def _frontier(points: pd.DataFrame) -> pd.DataFrame:
    """The Pareto-optimal points: none other is at least as fast per user and per GPU."""
    ordered = points.sort_values(["user_tok_s", "gpu_tok_s"], ascending=[False, False])
    best, keep = -np.inf, []
    for index, y in zip(ordered.index, ordered["gpu_tok_s"], strict=True):
        if y > best:
            keep.append(index)
            best = y
    return points.loc[keep].sort_values("user_tok_s")


def _pareto(data: pd.DataFrame, machine: str, path: Path) -> Path | None:
    """vLLM's plot_pareto shape: output tok/s per GPU against tok/s per user (1000 / TPOT),
    one point per configuration and concurrency, a panel per temperature; the frontier
    drawn per CUDA-graph mode, since eager and graph points are not comparable."""
    gpus = pd.to_numeric(data["gpu_count"], errors="coerce")
    per_gpu = gpus.notna().all() and bool((gpus > 0).all())
    frame = data.assign(
        user_tok_s=1000.0 / pd.to_numeric(data["tpot_ms_median"], errors="coerce"),
        gpu_tok_s=pd.to_numeric(data["output_tok_s_median"], errors="coerce") / (gpus if per_gpu else 1.0),
    ).replace([np.inf, -np.inf], np.nan).dropna(subset=["user_tok_s", "gpu_tok_s"])
    if frame.empty or not (frame["algorithm"] == "DDTREE").any():
        return None
    temps = sorted(frame["temperature"].unique())
    fig, axes = _figure(1, len(temps), f"{machine} — throughput per {'GPU' if per_gpu else 'server'} "
                                       "against throughput per user")
    for col, temp in enumerate(temps):
        ax = axes[0][col]
        ax.set_title(f"temperature {temp:g}", fontsize=10)
        panel = frame[frame["temperature"] == temp]
        for graph, face, style in ((True, None, "-"), (False, "white", "--")):
            points = panel[panel["cuda_graph"] == graph]
            if points.empty:
                continue
            for algo, color in _ALGO_COLORS.items():
                pts = points[points["algorithm"] == algo]
                if not pts.empty:
                    ax.scatter(pts["user_tok_s"], pts["gpu_tok_s"], s=34, zorder=3, marker="o" if graph else "D",
                               facecolors=face or color, edgecolors=color, linewidths=1.4,
                               label=f"{algo}{'' if graph else ', eager'}")
            front = _frontier(points)
            ax.plot(front["user_tok_s"], front["gpu_tok_s"], style, color="0.2", lw=1.2, zorder=2,
                    label="Pareto frontier" + ("" if graph else ", eager"))
            for _, row in front.iterrows():
                ax.annotate(_label(row), (row["user_tok_s"], row["gpu_tok_s"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("output tokens/s per user (1000 / median TPOT)")
        ax.set_ylabel(f"output tokens/s per {'GPU' if per_gpu else 'server'} (median)")
        ax.grid(alpha=0.3)
    handles: dict[str, Artist] = {}
    for ax in axes.ravel():
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    # Three entries a row per panel: a one-panel figure is too narrow for more.
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncol=min(3 * len(temps), len(handles)), fontsize=9)
    _save(fig, path, dpi=110)
    plt.close(fig)
    return path


def _machine_runs(grouped: pd.DataFrame) -> list[tuple[str, str | None, pd.DataFrame]]:
    """(machine, run, its cells) per machine and run of ``grouped``; the run None where the
    machine holds one run only (its figures are named by the machine alone, as before runs
    were told apart) or runs were pooled."""
    runs = grouped["run"] if "run" in grouped else pd.Series(None, index=grouped.index, dtype=object)
    runs = runs.astype(object).where(runs.notna(), None)
    out: list[tuple[str, str | None, pd.DataFrame]] = []
    for machine in sorted({str(m) for m in grouped["machine"]}):
        mine = grouped["machine"].astype(str) == machine
        names = sorted({str(r) for r in runs[mine] if r is not None})
        if len(names) <= 1:
            out.append((machine, None, grouped[mine]))
        else:
            out.extend((machine, run, grouped[mine & (runs == run)]) for run in names)
    return out


def write_plots(grouped: pd.DataFrame, out_dir: Path, *, run_labels: Mapping[str, str] | None = None) -> list[Path]:
    """Write the four figures per machine of ``grouped`` into ``out_dir``; return paths. A
    machine with cells of several runs (report.runs) gets four per run, named and titled by
    the run (``run_labels``: how a run is named)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{out_dir}: cannot create the plot folder: {write_problem(exc)}") from None
    written: list[Path] = []
    groups = _machine_runs(grouped)
    names = [machine if run is None else f"{machine} run {run}" for machine, run, _ in groups]
    slugs = _slugs(names)
    for (machine, run, data), name in zip(groups, names, strict=True):
        slug = slugs[name]
        title = machine if run is None else f"{machine} — {(run_labels or {}).get(run, f'run {run}')}"
        for maybe in (
            _line_plot(data, title, "output_tok_s_median", "output throughput (tokens/s, median)",
                       "throughput vs DDTree budget", out_dir / f"{slug}-throughput.png", baselines=True),
            _line_plot(data, title, "accept_length_median", "acceptance length (tokens / verify step)",
                       "acceptance length vs DDTree budget", out_dir / f"{slug}-accept-length.png", baselines=False),
            _heatmap(data, title, out_dir / f"{slug}-speedup-heatmap.png"),
            _pareto(data, title, out_dir / f"{slug}-pareto.png"),
        ):
            if maybe is not None:
                written.append(maybe)
    return written


def write_predicted_plots(pvm: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Per machine, predicted against measured acceptance and output tok/s, one point per
    cell that was both predicted and measured (``report.predicted.predicted_vs_measured``'s
    frame), a colour per temperature, marker size by concurrency, the diagonal where they
    agree: ``<machine>-predicted-vs-measured.png``. Predicted-only cells have no point."""
    both = pvm.loc[pvm["measured"].astype(bool)] if len(pvm) else pvm
    if both.empty:
        return []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{out_dir}: cannot create the plot folder: {write_problem(exc)}") from None
    machines = both["gpu_name"].fillna(both["host"]).astype(str)
    slugs = _slugs(sorted(machines.unique()))
    written: list[Path] = []
    for machine in sorted(machines.unique()):
        data = both.loc[machines == machine]
        fig, axes = _figure(1, 2, f"{machine}: predicted vs measured (bench --predict)")
        temps = sorted(data["temperature"].unique())
        colours = plt.get_cmap("viridis")(np.linspace(0.1, 0.85, max(1, len(temps))))
        for ax, (pred, meas, label) in zip(axes[0], (
            ("predicted_accept", "measured_accept", "acceptance length (tokens / verify step)"),
            ("predicted_tok_s", "measured_tok_s", "output throughput (tokens/s)"),
        ), strict=True):
            for colour, t in zip(colours, temps, strict=True):
                sub = data.loc[data["temperature"] == t]
                ax.scatter(sub[meas], sub[pred], s=18 + 6 * np.log2(sub["concurrency"].astype(float)),
                           color=colour, label=f"T={t:g}", alpha=0.8)
            low = float(min(data[pred].min(), data[meas].min()))
            high = float(max(data[pred].max(), data[meas].max()))
            ax.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel(f"measured {label}")
            ax.set_ylabel(f"predicted {label}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        path = out_dir / f"{slugs[machine]}-predicted-vs-measured.png"
        _save(fig, path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
