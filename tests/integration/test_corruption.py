"""A damaged committed checkpoint is named by ``ckpt verify`` and passed over by ``auto`` resume."""

from __future__ import annotations

import shutil

from trainguard.checkpoint.resume import choose_resume_checkpoint
from trainguard.cli import main
from trainguard.faults.files import corrupt_file, delete_file, truncate_file

from helpers.runs import events, ok, train, trainguard

DAMAGE = {"corrupt": corrupt_file, "truncate": truncate_file, "delete": delete_file}


def _files_of(ckpt_dir):
    return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*") if p.is_file())


def test_every_file_of_a_checkpoint_is_protected(committed_run, tmp_path, capsys):
    newest = committed_run / "checkpoints/global_step_8"
    files = _files_of(newest)
    assert {"trainguard.json", ".metadata", "__0_0.distcp", "extra_state_world_size_2_rank_1.pt"} <= set(files)
    for kind, damage in DAMAGE.items():
        for name in files:
            run = tmp_path / f"{kind}-{name.replace('/', '_')}"
            shutil.copytree(committed_run, run)
            damage(run / "checkpoints/global_step_8" / name)

            code = main(["ckpt", "verify", str(run), "--step", "8"])
            out = capsys.readouterr().out
            assert code == 1, (kind, name, out)
            assert f"global_step_8/{name}" in out, (kind, name, out)

            warnings: list[str] = []
            chosen = choose_resume_checkpoint("auto", run / "checkpoints", warn=warnings.append)
            assert chosen is not None and chosen.name == "global_step_4", (kind, name)
            assert any("global_step_8" in w for w in warnings), (kind, name, warnings)


def test_auto_resume_falls_back_past_a_corrupted_checkpoint(tmp_path):
    run = tmp_path / "run"
    ok(train(run, 2, 8, "--save-interval", "4", faults="corrupt:step=8,file=__1_0.distcp"))
    verify = trainguard("ckpt", "verify", str(run))
    assert verify.returncode == 1
    assert "BAD global_step_8/__1_0.distcp" in verify.stdout and "OK global_step_4" in verify.stdout

    resumed = ok(train(run, 2, 10, "--save-interval", "4", "--resume", "auto"))
    assert "global_step_8" in resumed.stdout and "__1_0.distcp" in resumed.stdout  # the warning names both
    assert events(run, "run_started")[-1]["resumed_from"].endswith("global_step_4")
    assert events(run, "run_finished")[-1]["step"] == 10


def test_no_verifiable_checkpoint_exits_4(committed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(committed_run, run)
    for step in (4, 8):
        corrupt_file(run / f"checkpoints/global_step_{step}/__0_0.distcp")
    proc = train(run, 2, 10, "--save-interval", "4", "--resume", "auto")
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "no usable checkpoint" in proc.stderr
