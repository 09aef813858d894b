"""The drill's last lines: a report path is shown only when ``trainguard report`` wrote it, and the drill
passes only with the report written (a failed report once printed its path and "drill passed")."""

from __future__ import annotations

from pathlib import Path

from trainguard.demo.drill import DrillReport, Fault, Outcome, drill_verdict

MERGED = "merged to hf/ and loaded with transformers: 3 tensors equal the checkpoint's"


def handled(ok: bool = True) -> list[Outcome]:
    return [Outcome(Fault("kill:rank=1,step=5", "a rank SIGKILLed"), 5, "exit -9", "restarted", "1 s", "1", ok)]


def test_a_failed_report_is_not_shown_and_fails_the_drill(tmp_path: Path):
    stale = tmp_path / "report.html"
    stale.write_text("<html>from an earlier drill</html>")  # present, but this drill's report failed
    report = DrillReport(stale, exit_code=1, log_path=tmp_path / "drill.log")
    assert not report.written
    assert str(stale) not in report.line() and "not written" in report.line() and "exited 1" in report.line()
    passed, verdict = drill_verdict(handled(), True, MERGED, report)
    assert not passed
    assert "drill passed" not in verdict and verdict.startswith("drill failed") and "report not written" in verdict


def test_a_report_that_exited_0_without_its_file_is_not_written(tmp_path: Path):
    report = DrillReport(tmp_path / "report.html", exit_code=0, log_path=tmp_path / "drill.log")
    assert not report.written and not drill_verdict(handled(), True, MERGED, report)[0]


def test_the_drill_passes_only_when_everything_held(tmp_path: Path):
    path = tmp_path / "report.html"
    path.write_text("<html></html>")
    report = DrillReport(path, exit_code=0, log_path=tmp_path / "drill.log")
    assert report.line() == f"report: {path}"
    passed, verdict = drill_verdict(handled(), True, MERGED, report)
    assert passed and verdict.startswith("drill passed: 1/1 faults handled")
    assert not drill_verdict(handled(ok=False), True, MERGED, report)[0]
    assert "DIFFERENT" in drill_verdict(handled(), False, MERGED, report)[1]
    assert not drill_verdict(handled(), True, "merge failed: ...", report)[0]


def test_a_failed_run_names_what_ended_its_last_incarnation(tmp_path: Path):
    from trainguard.demo.drill import last_failure
    from trainguard.events import EventLog

    assert last_failure(tmp_path) == ""  # no events at all
    events = EventLog(tmp_path / "events.jsonl", rank=-1)
    events.emit("incarnation_ended", incarnation=0, detail="rank 3 on node1 exited -9")
    events.emit("incarnation_ended", incarnation=1,
                detail="rank 0 on node0 failed (exit 1): TypeError: DeviceMesh.__init__() got an unexpected "
                       "keyword argument '_rank'")
    events.close()
    assert last_failure(tmp_path) == (": rank 0 on node0 failed (exit 1): TypeError: DeviceMesh.__init__() got "
                                      "an unexpected keyword argument '_rank'")
