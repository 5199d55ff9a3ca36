"""PNG plots of a report (matplotlib's object API: no pyplot, no global state, no display).

Each plot is drawn only when the report holds its data; `write_plots` returns the files written.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from pipeline.base.fileio import atomic_path
from pipeline.results.format import PLOTS
from pipeline.results.metrics import Speed, Stat
from pipeline.results.mix_render import allocation_grid, mix_of
from pipeline.results.query import models
from pipeline.results.schema import Report
from pipeline.results.serve_table import CB, KV, PLAIN, SPEC, STATIC, TECHNIQUES_PLOT, technique_rows

_MIB = 2**20
TASK_PLOT = "task_recovery_vs_bits.png"  # [validate.tasks] (drawn only when a variant has task recovery)
MIX_PARETO_PLOT = "ppl_ratio_vs_bits.png"  # [quantize.mix] (drawn only when a variant is mixed)
MIX_ALLOCATION_PLOT = "mix_allocation.png"


def write_plots(report: Report, out_dir: Path) -> list[str]:
    out_dir = Path(out_dir)
    written = []
    extra = {"task_recovery": TASK_PLOT, "techniques": TECHNIQUES_PLOT, "mix_pareto": MIX_PARETO_PLOT,
             "mix_allocation": MIX_ALLOCATION_PLOT}
    for key, draw in (("frontier", frontier_plot), ("decode", decode_plot), ("acceptance", acceptance_plot),
                      ("task_recovery", recovery_plot), ("techniques", techniques_plot),
                      ("mix_pareto", mix_pareto_plot), ("mix_allocation", mix_allocation_plot)):
        fig = draw(report)
        path = out_dir / (PLOTS.get(key) or extra[key])
        if fig is None:
            path.unlink(missing_ok=True)  # stale plot from an earlier render: its data is gone
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
        written.append(path.name)
    return written


def _figure(width: float = 7.0, height: float = 4.5):
    return Figure(figsize=(width, height), layout="constrained")


def _subtitle(report: Report) -> str:
    model = report.model
    if model is None:
        return ""
    bits = [str(model.name or model.source or "")]
    if model.random_init:
        bits.append("random init: quality meaningless")
    return " — ".join(b for b in bits if b)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both axes (smaller size and lower perplexity), sorted by size."""
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def frontier_plot(report: Report):
    """Perplexity vs size on disk for the baseline and every variant, with the Pareto front."""
    pts = []
    for name, m in models(report):
        ppl, disk = m.perplexity.value if m.perplexity else None, m.size_on_disk_bytes
        if isinstance(ppl, (int, float)) and isinstance(disk, (int, float)) and disk > 0:
            pts.append((name, disk / _MIB, float(ppl), m.method or "baseline"))
    if not pts:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    methods = sorted({p[3] for p in pts})
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for method in methods:
        mine = [p for p in pts if p[3] == method]
        ax.scatter([p[1] for p in mine], [p[2] for p in mine], s=90 if method == "baseline" else 50,
                   marker="*" if method == "baseline" else "o", color=colors[method], label=method, zorder=3)
    front = pareto([(p[1], p[2]) for p in pts])
    ax.plot([f[0] for f in front], [f[1] for f in front], "--", color="grey", lw=1, label="Pareto front", zorder=2)
    for name, x, y, _ in pts:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    xs = [p[1] for p in pts]
    if max(xs) / max(min(xs), 1e-9) > 4:
        ax.set_xscale("log")
    ax.set_xlabel("size on disk (MiB)")
    protocol = (report.baseline.perplexity.protocol if report.baseline and report.baseline.perplexity else None) or ""
    ax.set_ylabel(f"perplexity ({protocol})" if protocol else "perplexity")
    ax.set_title("Quality / size frontier (lower left is better)\n" + _subtitle(report), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _decode_rows(report: Report) -> list[tuple[str, Speed]]:
    rows: list[tuple[str, Speed | None]] = [(n, m.speed) for n, m in models(report)]
    if report.draft is not None:
        rows.append((report.draft.name or "draft", report.draft.speed))
    return [(n, s) for n, s in rows if s is not None and s.decode is not None]


def decode_plot(report: Report):
    """Decode tokens/s per model: batch 1 and the largest batch, bars at the median, min-max whiskers."""
    rows = _decode_rows(report)
    if not rows:
        return None
    batches = sorted({int(b) for _, s in rows for b in s.decode or {}})
    shown = [b for b in (1, batches[-1]) if b in batches][: 2 if batches[-1] != 1 else 1]
    fig = _figure(3.2 + 1.1 * len(rows) * len(shown), 4.5)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    names = [n for n, _ in rows]
    for ax, batch in zip(axes, shown, strict=True):
        med, lo, hi = [], [], []
        for _, s in rows:
            st = s.decode_at(batch) or Stat()
            m = st.given("median", 0.0) or 0.0
            med.append(m)
            lo.append(m - st.given("min", m))
            hi.append(st.given("max", m) - m)
        bars = ax.bar(range(len(names)), med, yerr=[lo, hi], capsize=4,
                      color=["C7" if n == "baseline" else "C0" for n in names])
        ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    device = rows[0][1].device_name or rows[0][1].device or ""
    fig.suptitle(f"Decode speed, median of runs (whiskers: min–max) — {device}\n{_subtitle(report)}", fontsize=10)
    return fig


def acceptance_plot(report: Report):
    """Acceptance rate at each draft position (accepted / drafted), one line per sampling mode."""
    draft = report.draft
    spec = draft.speculative if draft else None
    if draft is None or spec is None:
        return None
    series = []
    for mode, s in spec.items():
        acc, drafted = s.accepted_by_position, s.drafted_by_position
        if acc and drafted is not None and len(acc) == len(drafted):
            rates = [a / d if d else float("nan") for a, d in zip(acc, drafted, strict=True)]
            series.append((mode, rates, s.alpha))
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for i, (mode, rates, alpha) in enumerate(series):
        label = f"{mode} (α={alpha:.2f})" if isinstance(alpha, (int, float)) else mode
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=f"C{i}", label=label)
    k = max(len(r) for _, r, _ in series)
    ax.set_xticks(range(1, k + 1))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("accepted / drafted at this position")
    ax.set_title(f"Draft acceptance by position: {draft.name} → {draft.verifier or '?'}\n"
                 + _subtitle(report), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def recovery_plot(report: Report):
    """Average task recovery (paired 95 % interval as error bars) against bits per weight, one point per
    variant with both; None when no variant has them."""
    pts = []
    for name, e in report.variants.items():
        avg = (e.task_recovery or {}).get("average") or {}
        if e.bits_per_weight is not None and avg.get("recovery") is not None:
            pts.append((e.bits_per_weight, avg["recovery"], avg.get("low"), avg.get("high"), name))
    if not pts:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for x, y, lo, hi, name in pts:
        err = [[y - lo], [hi - y]] if lo is not None and hi is not None else None
        ax.errorbar([x], [y], yerr=err, fmt="o", capsize=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("bits per weight (decoder linears, as stored)")
    above = any((e.task_recovery or {}).get("definition") for e in report.variants.values())
    ax.set_ylabel("average task recovery " + ("above chance\n(variant - chance) / (baseline - chance)" if above
                                              else "(variant / baseline)"))
    ax.set_title("Task recovery vs bits per weight\n" + _subtitle(report), fontsize=9)
    return fig


# the lines of the techniques plot: batch-1 rows are single points, the others one line per model over N
_TECH_STYLE = {PLAIN: ("x", ""), KV: ("o", ""), STATIC: ("o", "-"), CB: ("s", "--"), SPEC: ("*", "")}


def techniques_plot(report: Report):
    """The techniques table as one figure (pipeline/results/serve_table.py technique_rows): output tok/s against
    batch size / concurrency N, and p99 time per output token against output tok/s; a colour per model, a marker
    and line style per technique. Static batching's line starts at its batch-1 KV-cache point."""
    rows = [r for r in technique_rows(report) if r.tok_s and (r.technique in _TECH_STYLE or r.kind == "server")]
    if not rows:
        return None
    fig = _figure(12.0, 4.8)
    left, right = fig.subplots(1, 2)
    names = list(dict.fromkeys(r.model for r in rows))
    for i, name in enumerate(names):
        mine = [r for r in rows if r.model == name]
        for tech in dict.fromkeys(r.technique for r in mine):
            pts = sorted((r for r in mine if r.technique == tech or (tech == STATIC and r.technique == KV)),
                         key=lambda r: r.n)
            if tech == KV and any(r.technique == STATIC for r in mine):
                continue  # drawn as the first point of the static batching line
            marker, ls = _TECH_STYLE.get(tech, ("s", ":"))
            label = f"{name}: {tech}" + (" (N=1: KV cache)" if tech == STATIC and pts[0].n == 1 else "")
            style = dict(color=f"C{i % 10}", marker=marker, linestyle=ls or "none", label=label)
            left.plot([r.n for r in pts], [r.tok_s for r in pts], **style)
            lat = [r for r in pts if r.p99_ms]
            if lat:
                right.plot([r.tok_s for r in lat], [r.p99_ms for r in lat], **style)
                for r in lat:
                    right.annotate(f"N={r.n}", (r.tok_s, r.p99_ms), textcoords="offset points", xytext=(3, 3),
                                   fontsize=6)
    ns = sorted({r.n for r in rows})
    left.set_xscale("log", base=2)
    left.set_xticks(ns, [str(n) for n in ns])
    left.set_xlabel("batch size (generate) / concurrency (server)")
    left.set_ylabel("output tokens/s (all sequences)")
    left.set_title("Throughput vs concurrency", fontsize=10)
    right.set_xlabel("output tokens/s (all sequences)")
    right.set_ylabel("p99 ms per output token (one sequence)")
    right.set_title("p99 latency vs throughput", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle("Techniques: plain decoding, KV cache, static and continuous batching, speculative decoding\n"
                 + _subtitle(report), fontsize=10)
    return fig


def mix_pareto_plot(report: Report):
    """Perplexity ratio against bits per weight for every variant with both, mixed ones marked, with the Pareto
    front; None when no variant is mixed ([quantize.mix])."""
    if not any(mix_of(e) for e in report.variants.values()):
        return None
    pts = [(e.bits_per_weight, e.ppl_ratio, name, mix_of(e) is not None) for name, e in report.variants.items()
           if e.bits_per_weight is not None and e.ppl_ratio is not None]
    if not pts:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for mixed, marker, label in ((False, "o", "uniform"), (True, "^", "mixed ([quantize.mix])")):
        mine = [p for p in pts if p[3] == mixed]
        if mine:
            ax.scatter([p[0] for p in mine], [p[1] for p in mine], marker=marker, s=55, label=label, zorder=3)
    front = pareto([(p[0], p[1]) for p in pts])
    ax.plot([f[0] for f in front], [f[1] for f in front], "--", color="grey", lw=1, label="Pareto front", zorder=2)
    for x, y, name, _ in pts:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("bits per weight (decoder linears, as stored)")
    ax.set_ylabel("perplexity ratio to the baseline")
    if max(p[1] for p in pts) / max(min(p[1] for p in pts), 1e-9) > 3:
        ax.set_yscale("log")
    ax.set_title("Mixed and uniform precision: quality per bit (lower left is better)\n" + _subtitle(report),
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def mix_allocation_plot(report: Report):
    """Bits per unit and layer of each mixed variant, as a heat map (group size written in each cell)."""
    mixed = [(name, m) for name, e in report.variants.items() if (m := mix_of(e))]
    if not mixed:
        return None
    fig = _figure(width=3.2 + 2.6 * len(mixed), height=6.5)
    axes = fig.subplots(1, len(mixed), squeeze=False)[0]
    image = None
    top = max([8.0] + [float(a["bits"]) for _, m in mixed for a in m["allocation"].values()])
    for ax, (name, mix) in zip(axes, mixed, strict=True):
        layers, cols = allocation_grid(mix)
        grid = [[(cell or {}).get("bits", float("nan")) for cell in row] for row in layers]
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=2, vmax=top, interpolation="nearest")
        for i, row in enumerate(layers):
            for j, cell in enumerate(row):
                if cell:
                    g = cell.get("group_size")
                    text = cell["type"] if "type" in cell else "ch" if g == -1 else str(g)
                    ax.text(j, i, text, ha="center", va="center", fontsize=5, color="w")
        ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(layers)), [str(i) for i in range(len(layers))], fontsize=6)
        ax.set_ylabel("decoder layer")
        ax.set_title(f"{name}: {mix['spent']['bits_per_weight']} bits per weight", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="bits per weight (cell text: group size, ch = per channel; or the "
                                                  "llama.cpp type)")
    return fig
