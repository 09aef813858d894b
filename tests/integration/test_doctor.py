"""trainguard doctor: burn-in with an injected miscompute, collectives across local ranks, storage, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.runs import events, trainguard, worker_env
from trainguard.doctor import self_test
from trainguard.doctor.burnin import burn_in
from trainguard.doctor.report import CheckResult, DoctorReport
from trainguard.doctor.storage import check_storage
from trainguard.errors import ConfigError
from trainguard.faults import FaultInjector
from trainguard.faults.spec import parse_faults

CPU = torch.device("cpu")


def test_a_clean_burn_in_is_bitwise_repeatable_and_within_the_error_bound():
    result = burn_in(CPU, reps=6, size=64)
    assert result.ok, result.detail
    assert result.metrics["differing_reps"] == [] and result.metrics["max_error_over_bound"] < 1.0


def test_one_corrupted_repetition_fails_the_burn_in_and_is_named():
    result = burn_in(CPU, reps=6, size=64, faults=parse_faults("miscompute:rep=4"))
    assert not result.ok
    assert result.detail == "rep 4 of 6 differs from rep 0 (checksum mismatch)"


def test_a_corrupted_first_result_fails_against_the_float64_reference():
    result = burn_in(CPU, reps=4, size=64, faults=parse_faults("miscompute:rep=0,bit=exp"))
    assert not result.ok
    assert "rep 0 deviates from the float64 CPU reference" in result.detail
    assert "reps 1-3 of 4 differ from rep 0" in result.detail


def test_a_low_mantissa_flip_passes_the_bound_but_not_the_checksum():
    result = burn_in(CPU, reps=3, size=64, faults=parse_faults("miscompute:rep=2,bit=0"))
    assert not result.ok and result.detail == "rep 2 of 3 differs from rep 0 (checksum mismatch)"


def test_miscompute_grammar_and_the_trainer_ignores_it():
    (spec,) = parse_faults("miscompute:rep=3,rank=5")
    assert spec.kind == "miscompute" and spec.params["rep"] == 3 and spec.rank == 5 and spec.step == 0
    with pytest.raises(ConfigError, match="missing required key rep for miscompute"):
        parse_faults("miscompute:rank=1")
    with pytest.raises(ConfigError, match="unknown key 'step' for miscompute"):
        parse_faults("miscompute:rep=1,step=3")
    # a doctor fault on local rank 5 does not stop a 2-rank training run from starting
    FaultInjector(parse_faults("miscompute:rep=3,rank=5"), Path("/nonexistent"), 0, 2, lambda *a, **k: None)


def test_storage_check_writes_reads_back_and_cleans_up(tmp_path):
    result = check_storage(tmp_path / "ckpt", size_mb=4)
    assert result.ok, result.detail
    assert result.metrics["megabytes"] == 4 and list((tmp_path / "ckpt").iterdir()) == []


def test_storage_check_fails_on_an_unusable_directory(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result = check_storage(tmp_path / "file" / "ckpt", size_mb=1)
    assert not result.ok and result.detail.startswith("NotADirectoryError")


def test_report_reason_names_every_failure():
    report = DoctorReport("node7", 2, [CheckResult("burn-in", "rank 0 (cpu)", True, "fine"),
                                       CheckResult("burn-in", "rank 1 (cpu)", False, "rep 3 of 20 differs"),
                                       CheckResult("storage", "/ckpt", False, "OSError: disk full")])
    assert not report.healthy
    assert report.reason == "burn-in rank 1 (cpu): rep 3 of 20 differs; storage /ckpt: OSError: disk full"
    assert report.to_dict()["healthy"] is False


@pytest.fixture(scope="module")
def doctor_runs(tmp_path_factory):
    run = tmp_path_factory.mktemp("doctor") / "run"
    args = ("doctor", "--nproc", "2", "--run-dir", str(run), "--storage-mb", "2", "--reps", "8", "--size", "64")
    healthy = trainguard(*args, "--json")
    sick = trainguard(*args, env=worker_env(TRAINGUARD_FAULTS="miscompute:rep=5,rank=1"))
    return run, healthy, sick


def test_a_healthy_node_exits_0_with_every_check(doctor_runs):
    run, healthy, _ = doctor_runs
    assert healthy.returncode == 0, healthy.stderr[-2000:]
    report = json.loads(healthy.stdout)
    assert report["healthy"] and report["nproc"] == 2
    assert [(c["check"], c["target"]) for c in report["checks"]] == [
        ("burn-in", "rank 0 (cpu)"), ("burn-in", "rank 1 (cpu)"), ("collective", "2 local ranks"),
        ("storage", str(run / "checkpoints"))]
    assert "(gloo): exact" in report["checks"][2]["detail"]
    assert events(run, "doctor_passed")[0]["checks"] == 4


def test_an_injected_miscompute_makes_the_node_unhealthy_with_the_reason(doctor_runs):
    run, _, sick = doctor_runs
    assert sick.returncode == 1, sick.stderr[-2000:]
    assert "FAIL" in sick.stdout and "unhealthy" in sick.stdout
    assert "rank 1 (cpu): rep 5 of 8 differs from rep 0 (checksum mismatch)" in " ".join(sick.stdout.split())
    (failed,) = events(run, "doctor_failed")
    assert failed["reason"] == "burn-in rank 1 (cpu): rep 5 of 8 differs from rep 0 (checksum mismatch)"
    assert failed["failed"] == [{"check": "burn-in", "target": "rank 1 (cpu)",
                                 "detail": "rep 5 of 8 differs from rep 0 (checksum mismatch)"}]


def test_bad_doctor_input_is_one_line_exit_2(tmp_path):
    proc = trainguard("doctor", "--nproc", "0", "--dirs", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip() == "trainguard: error: --nproc must be ≥ 1, got 0"
    with pytest.raises(ConfigError, match="bad fault 'miscompute:rep=x': rep must be a non-negative integer"):
        self_test(dirs=[tmp_path], faults="miscompute:rep=x")
