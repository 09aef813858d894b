"""Recommends data-skip and health thresholds from the ``step`` events of a clean run.

The rules (``docs/guards.md`` explains them):

- ``global_norm_spike_threshold = nice_ceil(margin * max)``: the largest finite global norm the clean run
  produced (after ``ignore_first`` steps), with ``margin`` (default 1.5) head-room for drift, rounded
  up to three significant digits. Nothing a clean run did is skipped, by construction.
- ``global_norm_spike_count_threshold = min(100, max(10, 2 * L))``: ``L`` is the longest streak of
  consecutive steps whose norm was above the run's own p99, i.e. how long elevated norms last in
  healthy training. 10 is the reference's default; 2 x L leaves room for a longer natural streak;
  100 skipped steps in a row mean the run is not learning, whatever the data.
- ``embedding_local_norm_threshold = nice_ceil(margin * max)`` of the ``embedding_local_norm`` series,
  when the events carry one.

Non-finite values are reported and left out of every statistic; a step logged twice (redone after a
resume) counts once, with its last value; a step event with a true ``skipped`` field is left out.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.fs.fsio import atomic_write_bytes, atomic_write_json
from trainguard.errors import ConfigError
from trainguard.events import read_events

EVENTS_FILE = "events.jsonl"
JSON_FILE = "calibration.json"
PLOT_FILE = "calibration.png"

SERIES = ("global_norm", "embedding_local_norm")
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
MIN_FINITE = 10
DEFAULT_MARGIN = 1.5
DEFAULT_COUNT_THRESHOLD = 10  # the reference's default
MAX_COUNT_THRESHOLD = 100
ELEVATED_PERCENTILE = 99.0

RULES = {
    "global_norm_spike_threshold": "margin x max finite global_norm, rounded up to 3 significant digits",
    "global_norm_spike_count_threshold": (
        f"min({MAX_COUNT_THRESHOLD}, max({DEFAULT_COUNT_THRESHOLD}, 2 x longest streak of consecutive "
        f"steps with global_norm above its p99))"
    ),
    "embedding_local_norm_threshold": "margin x max finite embedding_local_norm, rounded up to 3 significant digits",
}


@dataclass
class Series:
    """One quantity over steps, sorted by step; values may be non-finite."""

    name: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def finite(self) -> tuple[list[int], list[float]]:
        pairs = [(s, v) for s, v in zip(self.steps, self.values) if math.isfinite(v)]
        return [s for s, _ in pairs], [v for _, v in pairs]


@dataclass
class Calibration:
    run_dir: str
    events: str
    margin: float
    ignore_first: int
    stats: dict[str, dict[str, Any] | None]
    longest_elevated_streak: int
    global_norm_spike_threshold: float
    global_norm_spike_count_threshold: int
    embedding_local_norm_threshold: float | None
    notes: list[str]
    out_dir: str | None = None  # where calibrate_run wrote its files
    plot: str | None = None  # the PNG written, None without matplotlib

    def recommendations(self) -> dict[str, Any]:
        return {
            "global_norm_spike_threshold": self.global_norm_spike_threshold,
            "global_norm_spike_count_threshold": self.global_norm_spike_count_threshold,
            "embedding_local_norm_threshold": self.embedding_local_norm_threshold,
        }

    def trainguard_keys(self) -> dict[str, Any]:
        return {
            "guards.skip.threshold": self.global_norm_spike_threshold,
            "guards.skip.count_threshold": self.global_norm_spike_count_threshold,
            "guards.health.embedding_threshold": self.embedding_local_norm_threshold,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "events": self.events,
            "margin": self.margin,
            "ignore_first": self.ignore_first,
            "series": self.stats,
            "longest_elevated_streak": self.longest_elevated_streak,
            "recommendations": self.recommendations(),
            "trainguard_keys": self.trainguard_keys(),
            "rules": RULES,
            "notes": self.notes,
            "yaml": yaml_snippet(self),
            "plot": self.plot,
        }


# ------------------------------------------------------------------------------------------ pure
def _as_float(value: Any) -> float | None:
    """A logged number; ``"nan"``/``"inf"`` strings (how events write them) become floats."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def step_series(events: Iterable[dict]) -> dict[str, Series]:
    """``global_norm`` and ``embedding_local_norm`` from ``step`` events, one value per step."""
    latest: dict[str, dict[int, float]] = {name: {} for name in SERIES}
    for event in events:
        if event.get("kind") != "step" or type(event.get("step")) is not int:
            continue
        step = event["step"]
        for name in SERIES:
            latest[name].pop(step, None)  # a redone step's last event wins, even where a field is absent
        if event.get("skipped"):
            continue
        for name in SERIES:
            value = _as_float(event.get(name))
            if value is not None:
                latest[name][step] = value
    out = {}
    for name, by_step in latest.items():
        steps = sorted(by_step)
        out[name] = Series(name, steps, [by_step[s] for s in steps])
    return out


def series_stats(series: Series) -> dict[str, Any] | None:
    """count (finite), non_finite, p50, p90, p99, p99.9, max, min and where the max is; None if empty."""
    if not series.steps:
        return None
    import numpy as np  # here, not at the top: this package's health rules are read by commands that need no numpy

    steps, values = series.finite()
    stats: dict[str, Any] = {"count": len(values), "non_finite": len(series.values) - len(values)}
    if values:
        array = np.asarray(values, dtype=np.float64)
        for key, q in PERCENTILES:
            stats[key] = float(np.percentile(array, q))
        at = int(np.argmax(array))
        stats.update(max=float(array[at]), max_step=steps[at], min=float(array.min()))
        stats.update(first_step=series.steps[0], last_step=series.steps[-1])
    return stats


def longest_streak_above(values: Iterable[float], level: float) -> int:
    longest = current = 0
    for value in values:
        current = current + 1 if value > level else 0
        longest = max(longest, current)
    return longest


def nice_ceil(x: float, digits: int = 3) -> float:
    """The smallest number >= x with ``digits`` significant digits (66.47 -> 66.5, 12345 -> 12400)."""
    if x <= 0 or not math.isfinite(x):
        return float(x)
    quantum = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    result = float(f"{math.ceil(x / quantum - 1e-9) * quantum:.{digits}g}")
    return result if result >= x else float(f"{(math.ceil(x / quantum) + 1) * quantum:.{digits}g}")


def count_threshold_for(streak: int) -> int:
    return min(MAX_COUNT_THRESHOLD, max(DEFAULT_COUNT_THRESHOLD, 2 * streak))


def calibrate(series: dict[str, Series], *, margin: float = DEFAULT_MARGIN, ignore_first: int = 0,
              run_dir: str = "", events: str = "") -> Calibration:
    """The recommendations from the series of a clean run (steps <= ``ignore_first`` left out)."""
    if not (math.isfinite(margin) and margin >= 1.0):
        raise ConfigError(f"--margin must be a number >= 1, got {margin!r}")
    if ignore_first < 0:
        raise ConfigError(f"--ignore-first must be >= 0, got {ignore_first}")
    kept = {}
    for name in SERIES:
        s = series.get(name) or Series(name)
        pairs = [(st, v) for st, v in zip(s.steps, s.values) if st > ignore_first]
        kept[name] = Series(name, [st for st, _ in pairs], [v for _, v in pairs])
    stats = {name: series_stats(kept[name]) for name in SERIES}
    norm = stats["global_norm"]
    found = norm["count"] if norm else 0
    if found < MIN_FINITE:
        after = f" after step {ignore_first}" if ignore_first else ""
        raise ConfigError(
            f"{events or 'events'}: only {found} finite global_norm values in step events{after}; "
            f"calibration needs at least {MIN_FINITE}"
        )
    notes = []
    _, norms = kept["global_norm"].finite()
    streak = longest_streak_above(norms, norm[f"p{ELEVATED_PERCENTILE:g}"])
    threshold = nice_ceil(margin * norm["max"])
    if norm["non_finite"]:
        notes.append(f"{norm['non_finite']} step(s) had a non-finite global_norm: a clean run should have none")
    if norm["max"] > 3 * norm["p99.9"]:
        notes.append(
            f"the largest global_norm ({norm['max']:.6g} at step {norm['max_step']}) is more than 3x its p99.9 "
            f"({norm['p99.9']:.6g}): if that step was a spike, not normal training, the threshold is too loose"
        )
    span = norm["last_step"] - norm["first_step"]
    if span > 0 and norm["max_step"] - norm["first_step"] <= 0.05 * span:
        notes.append(
            f"the largest global_norm is at step {norm['max_step']}, early in the run: early-training norms are "
            f"often larger than later ones; consider --ignore-first to calibrate on the settled phase"
        )
    embedding = stats["embedding_local_norm"]
    embedding_threshold = None
    if embedding is None:
        notes.append("no embedding_local_norm in the step events (enable guards.monitor / monitor_config.monitor_on)")
    elif embedding["count"] < MIN_FINITE:
        notes.append(
            f"only {embedding['count']} finite embedding_local_norm values; no embedding threshold recommended "
            f"(needs {MIN_FINITE})"
        )
    else:
        embedding_threshold = nice_ceil(margin * embedding["max"])
    return Calibration(
        run_dir=run_dir,
        events=events,
        margin=margin,
        ignore_first=ignore_first,
        stats=stats,
        longest_elevated_streak=streak,
        global_norm_spike_threshold=threshold,
        global_norm_spike_count_threshold=count_threshold_for(streak),
        embedding_local_norm_threshold=embedding_threshold,
        notes=notes,
    )


def yaml_snippet(cal: Calibration) -> str:
    """The recommendations in the reference's YAML keys (trainguard reads them as aliases)."""
    lines = [
        "use_skip_data_by_global_norm: True",
        "monitor_config:",
        "  monitor_on: True",
        "  check_for_global_norm: False",
        f"  global_norm_spike_threshold: {cal.global_norm_spike_threshold!r}",
        f"  global_norm_spike_count_threshold: {cal.global_norm_spike_count_threshold}",
    ]
    if cal.embedding_local_norm_threshold is not None:
        lines += [
            "use_checkpoint_health_monitor: True",
            "runner_wrapper:",
            "  local_norm: True",
            "callbacks:",
            "  - type: CheckpointMonitor",
            f"    embedding_local_norm_threshold: {cal.embedding_local_norm_threshold!r}",
        ]
    else:
        lines.append("# embedding_local_norm_threshold: no recommendation (no embedding_local_norm values)")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- I/O
def load_series(run_dir: str | os.PathLike) -> tuple[Path, dict[str, Series]]:
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"{run}: no such run directory")
    path = run / EVENTS_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (calibrate reads the step events a training run writes)")
    try:
        return path, step_series(read_events(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None


def plot_png(cal: Calibration, series: dict[str, Series]) -> bytes | None:
    """The series over steps with the recommended thresholds, and their histograms; None when
    matplotlib (a dependency) cannot be imported."""
    import numpy as np

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    import io

    thresholds = {"global_norm": cal.global_norm_spike_threshold,
                  "embedding_local_norm": cal.embedding_local_norm_threshold}
    names = [name for name in SERIES if cal.stats.get(name) and cal.stats[name]["count"]]
    fig = Figure(figsize=(12, 3.6 * len(names)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), 2, squeeze=False, width_ratios=[3, 1])
    for row, name in enumerate(names):
        s = series[name]
        steps, values = s.finite()
        if cal.ignore_first:
            pairs = [(st, v) for st, v in zip(steps, values) if st > cal.ignore_first]
            steps, values = [st for st, _ in pairs], [v for _, v in pairs]
        stats, threshold = cal.stats[name], thresholds[name]
        over, hist = axes[row]
        over.plot(steps, values, linewidth=0.8, color="tab:blue", label=name)
        bad = [st for st, v in zip(s.steps, s.values) if not math.isfinite(v) and st > cal.ignore_first]
        if bad:
            over.scatter(bad, [stats["max"]] * len(bad), marker="x", color="tab:red", label="non-finite")
        over.axhline(stats["p99"], color="grey", linestyle=":", linewidth=1, label=f"p99 = {stats['p99']:.4g}")
        if threshold is not None:
            over.axhline(threshold, color="tab:red", linestyle="--", linewidth=1.2,
                         label=f"recommended threshold = {threshold!r}")
        positive = min(values) > 0
        if positive and max(values + [threshold or 0]) / min(values) > 100:
            over.set_yscale("log")
        over.set_xlabel("step")
        over.set_ylabel(name)
        over.set_title(f"{name} over steps ({stats['count']} finite values)")
        over.legend(loc="upper right", fontsize="small")
        hi = max(values + ([threshold] if threshold is not None else []))
        if positive and hi / min(values) > 100:
            bins = np.geomspace(min(values), hi, 50)
            hist.set_xscale("log")
        else:
            bins = np.linspace(min(values), hi, 50) if hi > min(values) else 10
        hist.hist(values, bins=bins, color="tab:blue", alpha=0.8)
        if threshold is not None:
            hist.axvline(threshold, color="tab:red", linestyle="--", linewidth=1.2)
        hist.set_xlabel(name)
        hist.set_ylabel("steps")
        hist.set_title("histogram")
    fig.suptitle(f"trainguard guards calibrate: {cal.run_dir}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def calibrate_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, *,
                  margin: float = DEFAULT_MARGIN, ignore_first: int = 0) -> Calibration:
    """Reads ``RUN_DIR/events.jsonl``, writes ``calibration.json`` and ``calibration.png`` into ``out``
    (default ``run_dir``) and returns the calibration."""
    path, series = load_series(run_dir)
    cal = calibrate(series, margin=margin, ignore_first=ignore_first, run_dir=str(run_dir), events=str(path))
    out_dir = Path(out) if out is not None else Path(run_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{out_dir}: cannot create output directory: {exc}") from None
    cal.out_dir = str(out_dir)
    png = plot_png(cal, series)
    if png is None:
        cal.notes.append("matplotlib cannot be imported: no plot written (pip install 'matplotlib>=3.7')")
    else:
        atomic_write_bytes(out_dir / PLOT_FILE, png)
        cal.plot = str(out_dir / PLOT_FILE)
    atomic_write_json(out_dir / JSON_FILE, cal.to_json())
    return cal


def dumps(cal: Calibration) -> str:
    return json.dumps(cal.to_json(), indent=2)
