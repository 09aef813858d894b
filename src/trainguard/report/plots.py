"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state) as PNG bytes."""

from __future__ import annotations

import io
import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from trainguard.report.facts import RunFacts

HEALTH_COLOURS = {"healthy": "#2e9d4a", "unhealthy": "#d62728", None: "#8c8c8c"}
SKIP_COLOUR = "#d62728"
SDC_COLOUR = "#9467bd"
INCIDENT_COLOUR = "#ff7f0e"
RESTART_COLOUR = "#1f77b4"
EXCLUDED_COLOUR = "#8c564b"


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


def _figure(width: float, height: float):
    fig = Figure(figsize=(width, height), dpi=100, layout="tight")
    return fig, fig.subplots()


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _per_attempt(facts: RunFacts, attr: str):
    """(attempt, steps, values) for each start of the run: a step redone after a resume is its own line."""
    for attempt in sorted({p.attempt for p in facts.steps}):
        points = [p for p in facts.steps if p.attempt == attempt and _finite(getattr(p, attr))]
        if points:
            yield attempt, [p.step for p in points], [getattr(p, attr) for p in points]


def _points(steps: list[int]) -> dict:
    """Markers on short curves, so that a start of the run with a single step is still visible."""
    return {"marker": "o", "markersize": 3} if len(steps) <= 60 else {}


def _label(attempt: int, many: bool) -> str:
    return ("first run" if attempt == 0 else f"after restart {attempt}") if many else "run"


def loss_plot(facts: RunFacts) -> bytes:
    fig, ax = _figure(10, 3.6)
    many = len({p.attempt for p in facts.steps}) > 1
    for attempt, steps, values in _per_attempt(facts, "loss"):
        ax.plot(steps, values, lw=1.3, label=_label(attempt, many), **_points(steps))
    loss_at = {p.step: p.loss for p in facts.steps if _finite(p.loss)}
    skipped = sorted({s.step for s in facts.skips if s.step in loss_at})
    if skipped:
        ax.scatter(skipped, [loss_at[s] for s in skipped], marker="x", s=60, color=SKIP_COLOUR, zorder=3,
                   label="skipped step")
    _mark_detections(ax, facts)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss")
    _legend(ax)
    return _png(fig)


def grad_norm_plot(facts: RunFacts) -> bytes:
    fig, ax = _figure(10, 3.6)
    many = len({p.attempt for p in facts.steps}) > 1
    finite_norms = [p.global_norm for p in facts.steps if _finite(p.global_norm) and p.global_norm > 0]
    for attempt, steps, values in _per_attempt(facts, "global_norm"):
        ax.plot(steps, values, lw=1.3, label=_label(attempt, many), **_points(steps))
    if facts.skip_threshold is not None:
        ax.axhline(facts.skip_threshold, color=SKIP_COLOUR, ls="--", lw=1, label=f"skip threshold {facts.skip_threshold:g}")
    thresholds = [(s.step, s.threshold) for s in facts.skips if _finite(s.threshold)]
    if thresholds and facts.skip_threshold is None:
        ax.scatter(*zip(*thresholds), marker="_", s=200, color=SKIP_COLOUR, label="threshold at skipped step")
    top = max(finite_norms) * 3 if finite_norms else 10.0
    marks = [(s.step, s.global_norm if _finite(s.global_norm) else top) for s in facts.skips
             if s.global_norm is not None]
    if marks:
        ax.scatter(*zip(*marks), marker="x", s=60, color=SKIP_COLOUR, zorder=3, label="skipped step (NaN/Inf at top)")
    sdc_skips = [s.step for s in facts.skips if s.global_norm is None]
    for step in sdc_skips:
        ax.axvline(step, color=SKIP_COLOUR, lw=0.8, ls=":")
    _mark_detections(ax, facts)
    if finite_norms and max(finite_norms) / max(min(finite_norms), 1e-30) > 50:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("global gradient norm")
    ax.set_title("Gradient norm (before clipping)")
    _legend(ax)
    return _png(fig)


def _mark_detections(ax, facts: RunFacts) -> None:
    steps = sorted({d.step for d in facts.detections if d.step is not None})
    for i, step in enumerate(steps):
        ax.axvline(step, color=SDC_COLOUR, lw=1, alpha=0.7, label="SDC detection" if i == 0 else None)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def timeline_plot(facts: RunFacts) -> bytes:
    """Checkpoints by tier over wall time, coloured by health (hollow: deleted since), with restarts,
    incidents, exclusions and detections as vertical lines."""
    t0 = facts.first_time or min((c.time for c in facts.checkpoints if c.time is not None), default=0.0)
    tiers = sorted({c.tier for c in facts.checkpoints}, key=lambda t: (t != "durable", t != "local", t)) or ["durable"]
    fig, ax = _figure(10, 1.4 + 0.6 * len(tiers))
    for ckpt in facts.checkpoints:
        if ckpt.time is None:
            continue
        x, y = ckpt.time - t0, tiers.index(ckpt.tier)
        colour = HEALTH_COLOURS.get(ckpt.health, HEALTH_COLOURS[None])
        ax.scatter([x], [y], s=90, marker="o", edgecolors=colour, linewidths=2,
                   facecolors="white" if ckpt.deleted else colour, zorder=3)
        ax.annotate(str(ckpt.step), (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7)
    for attempt in facts.attempts[1:]:
        ax.axvline(attempt.started - t0, color=RESTART_COLOUR, ls="--", lw=1.2)
    for incident in facts.incidents:
        ax.axvline(incident.time - t0, color=INCIDENT_COLOUR, lw=1.5)
    for action in facts.actions:
        if action.kind == "node_excluded":
            ax.axvline(action.time - t0, color=EXCLUDED_COLOUR, lw=1.5, ls="-.")
    for d in facts.detections:
        ax.axvline(d.time - t0, color=SDC_COLOUR, lw=0.8, alpha=0.6)
    ax.set_yticks(range(len(tiers)), [f"{t} tier" for t in tiers])
    ax.set_ylim(-0.6, len(tiers) - 0.4)
    end = max(facts.now if facts.state == "live" else (facts.last_event_time or t0), t0 + 1) - t0
    ax.set_xlim(-0.02 * end, end * 1.03)
    ax.set_xlabel("seconds since the run started")
    ax.set_title("Checkpoints (number: step) and incidents over time")
    legend = [
        Line2D([], [], marker="o", ls="", color=HEALTH_COLOURS["healthy"], label="healthy"),
        Line2D([], [], marker="o", ls="", color=HEALTH_COLOURS["unhealthy"], label="unhealthy"),
        Line2D([], [], marker="o", ls="", color=HEALTH_COLOURS[None], label="health not monitored"),
        Line2D([], [], marker="o", ls="", markerfacecolor="white", color="black", label="deleted since"),
        Line2D([], [], color=INCIDENT_COLOUR, label="incident"),
        Line2D([], [], color=RESTART_COLOUR, ls="--", label="restart"),
        Line2D([], [], color=EXCLUDED_COLOUR, ls="-.", label="node excluded"),
        Line2D([], [], color=SDC_COLOUR, label="SDC detection"),
    ]
    ax.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def all_plots(facts: RunFacts) -> dict[str, bytes]:
    """Title → PNG, in page order; an empty run gives no curves."""
    plots = {}
    if facts.steps:
        plots["Loss"] = loss_plot(facts)
        plots["Gradient norm"] = grad_norm_plot(facts)
    if facts.checkpoints or facts.attempts:
        plots["Timeline"] = timeline_plot(facts)
    return plots
