"""Bad input: one line naming the key, file or value at fault, exit 2, and nothing written."""

from __future__ import annotations

import pytest

from trainguard.cli import main


def _run(capsys, tmp_path, *args):
    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), *args])
    err = capsys.readouterr().err.strip()
    assert not run_dir.exists(), "nothing may be written on bad input"
    return code, err


@pytest.mark.parametrize(
    "args, names",
    [
        (["--set", "train.stepz=3"], "train.stepz"),
        (["--set", "optimizer.lr=1"], "optimizer"),
        (["--set", "train.steps=many"], "train.steps"),
        (["--set", "checkpoint.async_save=3"], "checkpoint.async_save"),
        (["--save-interval", "-1"], "checkpoint.save_interval"),
        (["--steps", "0"], "train.steps"),
        (["--set", "model.preset=gpt5"], "model.preset"),
        (["--set", "checkpoint.keep_last=0"], "checkpoint.keep_last"),
        (["--nproc", "4", "--set", "parallel.tp=3"], "tp=3"),
        (["--nproc", "4", "--set", "parallel.dp_shard=2", "--set", "parallel.dp_replicate=1",
          "--set", "parallel.tp=1", "--set", "parallel.pp=1"], "dp_shard=2"),
        (["--nproc", "0"], "--nproc"),
        (["--set", "faults=explode:step=1"], "explode"),
        (["--set", "noequals"], "noequals"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(capsys, tmp_path, args, names):
    code, err = _run(capsys, tmp_path, *args)
    assert code == 2
    assert len(err.splitlines()) == 1 and names in err, err


def test_unreadable_and_invalid_config_files(capsys, tmp_path):
    code, err = _run(capsys, tmp_path, "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    code, err = _run(capsys, tmp_path, "--config", str(bad))
    assert code == 2 and "bad.yaml" in err and "line" in err
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  steps: 10\n  warmup: 3\n")
    code, err = _run(capsys, tmp_path, "--config", str(wrong))
    assert code == 2 and "train.warmup" in err and "wrong.yaml" in err


def test_resume_from_garbage_is_refused(capsys, tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "trainguard.json").write_text("{not json")
    code, err = _run(capsys, tmp_path, "--resume", str(garbage))
    assert code == 2 and "trainguard.json" in err and len(err.splitlines()) == 1
    code, err = _run(capsys, tmp_path, "--resume", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere" in err


def test_bad_faults_env_is_refused_before_launch(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_FAULTS", "kill:rank=0")
    code, err = _run(capsys, tmp_path)
    assert code == 2 and "TRAINGUARD_FAULTS" in err and "step" in err


def test_unknown_option_is_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--no-such-flag"])
    assert exc.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, value",
    [("NPU_ASD_UPPER_THRESH", "2,1"), ("NPU_ASD_SIGMA_THRESH", "5000,100000"), ("NPU_ASD_UPPER_THRESH", "1e6,1e4"),
     ("NPU_ASD_ENABLE", "4"), ("TRAINGUARD_SDC_UPPER_THRESH", "10")],
)
def test_malformed_sdc_env_is_refused(capsys, tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    code, err = _run(capsys, tmp_path)
    assert code == 2 and name in err and len(err.splitlines()) == 1, err
