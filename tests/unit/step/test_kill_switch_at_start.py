"""A fresh run started with its kill switch armed (docs/cli.md's `trainguard killswitch`, then the run):
nothing is trained, and the run is at step 0. The stop's event, log line and `trainguard status` once
said `step None` ("stopping at step None: ... (checkpoint: step None)", "the run is at step None")."""

from __future__ import annotations

import logging

import torch

import trainguard
from trainguard.config import load_config
from trainguard.events.log import read_events
from trainguard.events.rank_logging import LOGGER_NAME
from trainguard.report.facts import read_run
from trainguard.report.summary import status_rows


def test_a_fresh_run_with_the_kill_switch_armed_is_at_step_0_not_none(tmp_path, quiet, caplog):
    switch = tmp_path / "STOP"
    switch.write_text("armed")
    config = load_config(None, [f"lifecycle.kill_switch_path={switch}"])
    model = torch.nn.Linear(2, 1)
    guard = trainguard.Guard(tmp_path / "run", model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    step = guard.resume()
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert guard.should_stop(step, 5)
    assert guard.close() == 0 and guard.outcome.value == "not_started"
    stop = next(e for e in read_events(tmp_path / "run" / "events.jsonl") if e["kind"] == "lifecycle_stop")
    assert (stop["step"], stop["last_checkpoint"]) == (0, None)
    line = next(r.getMessage() for r in caplog.records if "stopping at step" in r.getMessage())
    assert "None" not in line and line.startswith("stopping at step 0:") and "(checkpoint: none)" in line
    state = dict(status_rows(read_run(tmp_path / "run")))["state"]
    assert "the run is at step 0)" in state and "None" not in state
