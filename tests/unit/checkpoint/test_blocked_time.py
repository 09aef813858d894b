"""Issue 38 item 9: the time a save blocks the loop counts the wait for the previous save to commit (the
log line said ``staged (blocked 1ms)`` after the loop had waited seconds for that commit)."""

from __future__ import annotations

import json
import logging
import threading

import torch

from trainguard.checkpoint.manager import CheckpointManager
from trainguard.events import EventLog

RELEASE_S = 1.0  # the previous save's commit hook holds it in flight until then (a slow store)


def test_a_save_that_waits_for_the_previous_commit_reports_the_wait(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    events = EventLog(tmp_path / "events.jsonl", rank=0, host="test")
    release = threading.Event()
    manager = CheckpointManager(tmp_path, model, optimizer, async_save=True, keep_last=5, events=events,
                                after_commit=lambda step, path: release.wait())
    manager.save_durable(1)
    threading.Timer(RELEASE_S, release.set).start()
    with caplog.at_level(logging.INFO, logger="trainguard"):
        blocked = manager.save_durable(2)  # global_step_1 is still in flight: its commit hook waits
    manager.close()
    events.close()
    saved = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (second,) = [e for e in saved if e["kind"] == "checkpoint_saved" and e["step"] == 2]
    assert blocked >= second["waiting_for_previous_s"] > 0
    assert second["blocked_s"] == blocked
    (line,) = [r.getMessage() for r in caplog.records if "global_step_2 staged" in r.getMessage()]
    assert "of it waiting for the previous save to commit" in line, line
    from trainguard.report.facts import read_run
    from trainguard.report.html import render

    facts = read_run(tmp_path)
    (fact,) = [c for c in facts.checkpoints if c.step == 2 and c.tier == "durable"]
    assert fact.blocked_s == blocked
    assert "<th>loop blocked s</th>" in render(facts, {}) and f"<td>{blocked:.3f}</td>" in render(facts, {})
