"""The report page: one self-contained HTML file (plots inlined as base64 PNG, no external resource)."""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Iterable, Sequence

from trainguard.report.facts import RunFacts
from trainguard.report.summary import status_rows

# Sets data-images-ready="loaded/total" on <body> once the page has loaded, counting the images that
# decoded (naturalWidth > 0): lets a headless browser test prove the plots render, not just exist.
_READY_SCRIPT = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var decoded = images.filter(function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-ready", decoded + "/" + images.length);
});
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
.unhealthy { color: #c00; font-weight: bold; } .healthy { color: #17802f; }
.muted { color: #777; }
"""


def _e(value: object) -> str:
    return html.escape("-" if value is None else str(value))


def _num(value: float | None, fmt: str = "{:.4g}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str) -> str:
    rows = list(rows)
    if not rows:
        return f'<p class="muted">{html.escape(empty)}</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _clock(facts: RunFacts, t: float | None) -> str:
    if t is None:
        return "-"
    offset = f" (+{t - facts.first_time:.1f} s)" if facts.first_time is not None else ""
    return html.escape(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + offset)


def render(facts: RunFacts, plots: dict[str, bytes]) -> str:
    sections = [
        "<h2>Status</h2>" + _table(["", ""], ([f"<b>{_e(k)}</b>", _e(v)] for k, v in status_rows(facts)), ""),
    ]
    for title, png in plots.items():
        data = base64.b64encode(png).decode("ascii")
        sections.append(f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
    sections += [
        "<h2>Incidents and time to recover</h2>" + _table(
            ["time", "cause", "last step done", "resumed after step", "back to training", "lost work redone"],
            ([_clock(facts, i.time), _e(i.cause), _e(i.last_step), _e(i.resumed_step),
              _num(i.back_to_training_s, "{:.1f} s"), _num(i.recovered_s, "{:.1f} s")] for i in facts.incidents),
            "No incident: the run never stopped before its end."),
        "<h2>Starts of the run (attempts)</h2>" + _table(
            ["attempt", "started", "resumed after step", "last step", "ended"],
            ([_e(a.index), _clock(facts, a.started), _e(a.resumed_step), _e(a.last_step),
              "finished" if a.finished else "stopped"] for a in facts.attempts),
            "No run start recorded."),
        "<h2>Restarts, node exclusions and recovery actions</h2>" + _table(
            ["time", "event", "step", "rank", "node", "reason", "seconds"],
            ([_clock(facts, a.time), _e(a.kind), _e(a.step), _e(a.rank), _e(a.node), _e(a.reason),
              _num(a.seconds, "{:.2f}")] for a in facts.actions),
            "None recorded (no supervisor restart, node exclusion, hang, local recovery, repair, rollback or backup event)."),
        "<h2>Skipped steps</h2>" + _table(
            ["step", "why", "global norm", "threshold"],
            ([_e(s.step), _e(s.reason), _num(s.global_norm), _num(s.threshold)] for s in facts.skips),
            "No step was skipped."),
        "<h2>SDC detections</h2>" + _table(
            ["step", "rank", "device", "point", "level", "rule", "value", "rerun verdict"],
            ([_e(d.step), _e(d.rank), _e(d.device), _e(d.point), _e(d.level), _e(d.rule), _num(d.value),
              _e(d.verdict)] for d in facts.detections),
            "No silent-data-corruption detection."),
        "<h2>Checkpoints</h2>" + _table(
            ["step", "tier", "committed", "save seconds", "loop blocked s", "size", "health", "now"],
            ([_e(c.step), _e(c.tier), _clock(facts, c.time), _num(c.seconds, "{:.2f}"), _num(c.blocked_s, "{:.3f}"),
              _num(c.size_bytes / 1e6 if c.size_bytes is not None else None, "{:.1f} MB"),
              f'<span class="{_e(c.health)}">{_e(c.health or "not monitored")}</span>',
              _e(f"deleted ({c.deleted})" if c.deleted else ("on disk" if c.present else "-"))]
             for c in facts.checkpoints),
            "No checkpoint."),
        "<h2>Faults injected</h2>" + _table(
            ["time", "step", "rank", "fault", "spec"],
            ([_clock(facts, f.get("time")), _e(f.get("step")), _e(f.get("rank")), _e(f.get("fault")),
              f"<code>{_e(f.get('spec'))}</code>"] for f in facts.faults),
            "No fault injected."),
    ]
    if facts.quorum_changes:
        sections.insert(2 + len(plots), "<h2>Live recovery: quorum changes</h2>" + _table(
            ["time", "epoch", "from step", "members", "left", "joining", "reason", "survivors lost", "time to rejoin"],
            ([_clock(facts, q.time), _e(q.epoch), _e(q.step), _e(q.members), _e(q.left or ""),
              _e(q.joining or ""), _e(q.reason), _num(q.survivors_lost_s, "{:.3f} s"), _num(q.rejoin_s, "{:.2f} s")]
             for q in facts.quorum_changes), ""))
    if facts.notes:
        sections.append("<h2>Could not read</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in facts.notes) + "</ul>")
    title = f"trainguard report: {facts.run_dir.name}"
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(facts.now))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style><script>{_READY_SCRIPT}</script></head>"
        f"<body><h1>{html.escape(title)}</h1><p class=\"muted\">{_e(facts.run_dir)} — generated {generated}</p>"
        + "\n".join(sections)
        + "</body></html>\n"
    )
