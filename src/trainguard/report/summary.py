"""The run's state in a few labelled lines: the ``status`` screen and the head of the HTML report."""

from __future__ import annotations

import time

from trainguard.report.facts import RunFacts


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def status_rows(facts: RunFacts) -> list[tuple[str, str]]:
    """The status as (label, value) lines; also the header table of the HTML report."""
    last = facts.last_step
    ckpt = facts.last_checkpoint
    skipped = sorted({s.step for s in facts.skips})
    levels = {}
    for d in facts.detections:
        levels[d.level] = levels.get(d.level, 0) + 1
    detection_text = "none"
    if facts.detections:
        steps = sorted({d.step for d in facts.detections if d.step is not None})
        by_level = ", ".join(f"level {lvl}: {n}" for lvl, n in sorted(levels.items(), key=lambda kv: kv[0] or 0))
        detection_text = f"{len(facts.detections)} ({by_level}) at steps {_some(steps)}"
    beat = facts.last_heartbeat
    rows = [
        ("run", str(facts.run_dir)),
        ("state", facts.state if facts.finish_reason in (None, "finished") else f"finished ({facts.finish_reason})"),
        ("step", "-" if last is None else str(last.step)),
        ("loss", "-" if last is None or last.loss is None else f"{last.loss:.4f}"),
        ("global norm", "-" if last is None or last.global_norm is None else f"{last.global_norm:.4g}"),
        ("last checkpoint", "-" if ckpt is None else
         f"step {ckpt.step} ({ckpt.tier}, {ckpt.health or 'health not monitored'})"
         + ("" if ckpt.time is None else f", {ago(facts.now - ckpt.time)}")),
        ("skipped steps", f"{len(skipped)}" + (f" at steps {_some(skipped)}" if skipped else "")),
        ("SDC detections", detection_text),
        ("restarts", str(facts.restarts)),
        ("excluded nodes", ", ".join(facts.excluded_nodes) or "none"),
        ("last heartbeat", "no heartbeats" if beat is None else ago(facts.now - beat)),
        ("last event", "-" if facts.last_event_time is None else
         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(facts.last_event_time))
         + f" ({ago(facts.now - facts.last_event_time)})"),
    ]
    if facts.heartbeats:
        rows.append(("heartbeats", "  ".join(
            f"rank {h.rank}: step {h.step if h.step is not None else '-'}"
            f" {h.phase or ''} {ago(facts.now - h.time) if h.time is not None else ''}".rstrip()
            for h in facts.heartbeats)))
    return rows


def _some(steps: list, limit: int = 10) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" … (+{len(steps) - limit})" if len(steps) > limit else "")
