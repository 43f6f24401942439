"""`report.md`'s plots and the report's files: average accuracy against % retrieval for every
method, and Figure 4's latency-accuracy trade-off along SR-RAG's tau sweep. Every file is written
to a temp path and renamed, as every artifact of the pipeline is (docs/pipeline.md)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrag.eval.report import display_name, method_order, number, render_report

REPORT_FILE, PLOTS_DIR = "report.md", "plots"
ACC_VS_RAG_PNG, LATENCY_PNG = "accuracy_vs_retrieval.png", "latency_accuracy.png"


def _atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def _points(curve: Sequence[dict], x_key: str, y_key: str, x_fn=lambda x: x) -> tuple[list, list]:
    pts = sorted((x_fn(number(p.get(x_key))), number(p.get(y_key))) for p in curve
                 if number(p.get(x_key)) is not None and number(p.get(y_key)) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot_acc_vs_rag(ax, results: dict) -> None:
    # lazy: matplotlib: only the plots need it, and it takes seconds to import
    from matplotlib import colormaps

    avg, curves = results.get("average") or {}, results.get("curves") or {}
    for i, m in enumerate(method_order(set(avg) | set(curves))):
        color = colormaps["tab20"](i % 20)  # 20 distinct colours: all twelve methods stay apart
        xs, ys = _points(curves.get(m) or [], "rag_frac", "acc", lambda x: 100 * x)
        if xs:
            ax.plot(xs, ys, "-", color=color, alpha=0.6, lw=1.2)
        e = avg.get(m) or {}
        x, y = number(e.get("rag_frac")), number(e.get("acc"))
        if x is not None and y is not None:
            ax.plot(100 * x, y, "o", color=color)
            ax.annotate(display_name(m), (100 * x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set(xlabel="% retrieval", ylabel="average accuracy", title="Accuracy vs retrieval budget")
    ax.grid(alpha=0.3)  # points are labelled in place: a legend would only repeat the names


def _plot_latency_accuracy(ax, results: dict) -> None:
    """Paper Figure 4: x = proportion verbalized (1 - % RAG) along SR-RAG's tau sweep; accuracy
    on the left axis, latency per item on the right; always-RAG and GenRead as reference points."""
    # Measured routed batches when the eval ran them (`figure4`), else the harness sweep.
    curve = results.get("figure4") or (results.get("curves") or {}).get("srrag") or []
    avg = results.get("average") or {}
    ax2 = ax.twinx()
    xs, acc = _points(curve, "rag_frac", "acc", lambda x: 1 - x)
    lx, lat = _points(curve, "rag_frac", "latency_s", lambda x: 1 - x)
    if xs:
        ax.plot(xs, acc, "-o", color="C0", ms=3, label="SR-RAG accuracy (tau sweep)")
    if lx:
        ax2.plot(lx, lat, "--s", color="C3", ms=3, label="SR-RAG latency (tau sweep)")
    for m, marker in (("srrag", "*"), ("srrag_always_rag", "^"), ("no_ft_always_rag", "v"), ("no_ft_genread", "D")):
        e = avg.get(m) or {}
        if (r := number(e.get("rag_frac"))) is None:
            continue
        if (a := number(e.get("acc"))) is not None:
            ax.plot(1 - r, a, marker, color="C0", ms=8, mfc="none", label=f"{display_name(m)} accuracy")
        if (t := number(e.get("latency_s"))) is not None:
            ax2.plot(1 - r, t, marker, color="C3", ms=8, mfc="none", label=f"{display_name(m)} latency")
    ax.set(xlabel="proportion of verbalization (1 - % RAG)", ylabel="accuracy", title="Latency-accuracy trade-off")
    ax2.set_ylabel("latency per item (s)")
    ax.grid(alpha=0.3)
    handles = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
    if handles:
        # Below the axes: inside, it hides the curves it explains.
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)


def write_plots(results: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Both PNGs into out_dir (always written, empty axes when the data is absent, so the report's
    links never dangle). Returns their paths."""
    # A Figure on an Agg canvas, not pyplot: no global backend switch and no figure registry, so
    # this is safe inside notebooks and threads and leaks nothing.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    # lazy: matplotlib: only the plots need it, and it takes seconds to import
    from matplotlib.figure import Figure

    out_dir, paths = Path(out_dir), []
    for name, draw in ((ACC_VS_RAG_PNG, _plot_acc_vs_rag), (LATENCY_PNG, _plot_latency_accuracy)):
        fig = Figure(figsize=(7, 6), dpi=100)
        FigureCanvasAgg(fig)
        draw(fig.add_subplot(), results)
        fig.tight_layout()
        paths.append(_atomic_write(out_dir / name, lambda f, fig=fig: fig.savefig(f, format="png")))
    return paths


def write_report(results: dict, workdir: str | os.PathLike) -> Path:
    """workdir/report.md plus workdir/plots/*.png, the report linking the plots."""
    workdir = Path(workdir)
    plots = write_plots(results, workdir / PLOTS_DIR)
    text = render_report(results, images=[p.relative_to(workdir).as_posix() for p in plots])
    return _atomic_write(workdir / REPORT_FILE, lambda f: f.write(text), mode="w")
