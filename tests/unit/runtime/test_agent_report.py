"""The agent's report of failed ranks holds each rank's error as text, one format whatever torchrun's
error file held, and the supervisor's line is the first line of that text."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainguard.runtime.launcher import _write_agent_report
from trainguard.runtime.nodes import ENV_AGENT_REPORT
from trainguard.runtime.supervisor import rank_error_line


def test_a_rank_error_recorded_by_record_reaches_the_report_and_the_supervisor_as_text(tmp_path, monkeypatch):
    """The launcher wrote a recorded error as JSON inside the report's JSON, which the supervisor parsed back."""
    error_file = tmp_path / "error.json"
    # what torch.distributed.elastic's @record writes for a rank's uncaught exception
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: boom\nwhile loading shard 3",
                                                  "extraInfo": {"py_callstack": "Traceback (most recent call "
                                                                                "last): ...", "timestamp": "1700000000"}}}))
    report = tmp_path / "report.json"
    monkeypatch.setenv(ENV_AGENT_REPORT, str(report))
    _write_agent_report(ChildFailedError("train", {3: ProcessFailure(0, 4242, 1, str(error_file))}))
    (entry,) = json.loads(report.read_text())["failures"]
    assert entry["rank"] == 3 and entry["message"] == "RuntimeError: boom\nwhile loading shard 3"
    assert rank_error_line(entry) == "RuntimeError: boom"
    assert rank_error_line({"rank": 3}) == rank_error_line({"message": " \n"}) == ""
