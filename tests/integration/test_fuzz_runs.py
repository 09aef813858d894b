"""Hostile and broken input against real 2-rank runs and the ckpt commands (issue 24): each case ends
in one line naming the file, key or value, with the documented exit code, and no raw traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from trainguard.cli import main
from trainguard.fs.layout import HEALTH_FILE, LATEST_FILE, MANIFEST_NAME

from helpers.mounts import tmpfs
from helpers.runs import events, train, trainguard, outside_file

TENSOR_FILE = "__1_0.distcp"


def _copy(committed_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(committed_run, run, symlinks=True)
    return run


def _flip_byte_inside_a_tensor(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("trainguard: error:")]


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]


def _edit_world_size(ckpt: Path, world_size: int) -> None:
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    data["world_size"] = world_size
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))


CKPT_DAMAGE = {
    "manifest world size 2->3": lambda c: _edit_world_size(c, 3),
    "manifest world size 2->1": lambda c: _edit_world_size(c, 1),
    "a tensor byte flipped": lambda c: _flip_byte_inside_a_tensor(c / TENSOR_FILE),
    "a file replaced by a symlink": lambda c: ((c / ".metadata").unlink(), (c / ".metadata").symlink_to(outside_file())),
    "a symlink out of huggingface/": lambda c: (c / "huggingface/vocab.json").symlink_to(outside_file()),
    "a fifo added": lambda c: os.mkfifo(c / "pipe"),
    "an empty directory added": lambda c: (c / "empty").mkdir(),
}


@pytest.mark.parametrize("damage", CKPT_DAMAGE.values(), ids=CKPT_DAMAGE.keys())
def test_every_reader_refuses_a_damaged_checkpoint(committed_run, tmp_path, capsys, damage):
    run = _copy(committed_run, tmp_path)
    ckpt = run / "checkpoints/global_step_8"
    damage(ckpt)
    assert main(["ckpt", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "BAD global_step_8/" in out and "OK global_step_4" in out

    commands = {
        "merge": ["ckpt", "merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "merged")],
        "convert": ["ckpt", "convert", "--from", str(ckpt), "--to", str(tmp_path / "converted")],
        "test": ["ckpt", "test", "--local_dir", str(ckpt / "huggingface"), "--reference", str(ckpt)],
        "backup": ["ckpt", "backup", str(run), f"file://{tmp_path}/mirror", "--step", "8", "--weights-only"],
    }
    for name, argv in commands.items():
        code = main(argv)
        err = capsys.readouterr().err
        assert code != 0, (name, err)
        lines = _error_lines(err)
        assert len(lines) == 1 and "global_step_8" in lines[0], (name, err)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "converted").exists()  # nothing laundered


@pytest.mark.parametrize("value", [b"../../etc", b"999", b"-5", b"", b"\x00\xff\x13binary", "symlink", "directory"])
def test_ckpt_verify_checks_the_tracker(committed_run, tmp_path, capsys, value):
    run = _copy(committed_run, tmp_path)
    tracker = run / "checkpoints" / LATEST_FILE
    tracker.unlink()
    if value == "symlink":
        tracker.symlink_to(outside_file())
    elif value == "directory":
        tracker.mkdir()
    else:
        tracker.write_bytes(value)
    assert main(["ckpt", "verify", str(run)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD")]
    assert len(lines) == 1 and lines[0].startswith(f"BAD {LATEST_FILE}: "), lines


def test_resume_passes_over_an_edited_manifest_and_repairs_tracker_and_health(committed_run, tmp_path):
    """Three rows of the issue in one run: the newest manifest edited (world size 2->3), the tracker a
    directory, health_ckpts.json not JSON: the run resumes from step 4, commits, and rewrites the tracker."""
    run = _copy(committed_run, tmp_path)
    root = run / "checkpoints"
    _edit_world_size(root / "global_step_8", 3)
    (root / LATEST_FILE).unlink()
    (root / LATEST_FILE).mkdir()
    (root / HEALTH_FILE).write_text("{not json")
    proc = train(run, 2, 10, "--save-interval", "4", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_traceback(proc)
    assert events(run, "run_started")[-1]["resumed_from"].endswith("global_step_4")
    assert "global_step_8" in proc.stdout + proc.stderr and HEALTH_FILE in proc.stdout + proc.stderr
    assert (root / LATEST_FILE).read_text() == "10\n"
    verify = trainguard("ckpt", "verify", str(run))
    assert verify.returncode == 0, verify.stdout


def test_a_fault_naming_a_module_one_rank_lacks_is_one_line_from_rank_0(tmp_path):
    """The site is checked where the hooks go in, on the rank the fault names (rank 1 here): every rank
    learns of it and stops, and rank 0 alone says so."""
    run = tmp_path / "run"
    proc = train(run, 2, 2, "--set", "faults=bitflip:rank=1,step=1,site=model.no_such_layer,where=output")
    assert proc.returncode == 2, proc.stderr[-3000:]
    _no_traceback(proc)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("trainguard: error: [rank 0] ") and "model.no_such_layer" in lines[0], lines
    assert lines[0].endswith("(rank 1)")
    assert "Terminating process" not in proc.stderr  # no rank was left to be killed


@pytest.fixture
def small_file_system(tmp_path):
    with tmpfs(tmp_path / f"small-{uuid.uuid4().hex[:6]}", "size=1m") as mount_point:
        yield mount_point


def test_a_full_disk_at_save_is_one_line_naming_the_directory(small_file_system):
    run = small_file_system / "run"
    proc = train(run, 2, 2, "--save-interval", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    _no_traceback(proc)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "file system full" in lines[0] and str(run / "checkpoints") in lines[0] and "bytes free" in lines[0]
    assert "the checkpoint of step 2 needs about" in lines[0]
    assert "Terminating process" not in proc.stderr  # the ranks that did not fail first stay quiet


def _random_damage(rng, run: Path) -> str:
    """One random kind of damage to the newest checkpoint (and maybe the tracker); returns what it did."""
    ckpt = run / "checkpoints/global_step_8"
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    target = rng.choice(files)
    kind = rng.choice(["flip", "truncate", "extend", "symlink", "fifo", "extra file", "manifest edit"])
    if kind == "flip":
        data = bytearray(target.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
    elif kind == "truncate":
        target.write_bytes(target.read_bytes()[: rng.randrange(target.stat().st_size)])
    elif kind == "extend":
        target.write_bytes(target.read_bytes() + os.urandom(rng.randint(1, 64)))
    elif kind == "symlink":
        target.unlink()
        target.symlink_to(outside_file())
    elif kind == "fifo":
        target.unlink()
        os.mkfifo(target)
    elif kind == "extra file":
        (target.parent / "planted.bin").write_bytes(os.urandom(16))
    else:
        _edit_world_size(ckpt, rng.choice([1, 3, 4]))
    if rng.random() < 0.5:
        tracker = run / "checkpoints" / LATEST_FILE
        tracker.unlink()
        tracker.write_bytes(rng.choice([b"../../etc", b"999", b"-5", b"", os.urandom(8)]))
        kind += " + tracker garbage"
    return f"{kind} of {target.relative_to(ckpt)}"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_damage_then_a_real_resume(committed_run, tmp_path, seed):
    """Random damage to the newest checkpoint of a real run, then `--resume auto`: it resumes from the
    previous one, without a traceback, and leaves a run that verifies (tracker rewritten)."""
    import random

    run = _copy(committed_run, tmp_path)
    what = _random_damage(random.Random(seed), run)
    proc = train(run, 2, 10, "--save-interval", "4", "--resume", "auto")
    assert proc.returncode == 0, (what, proc.stderr[-3000:])
    _no_traceback(proc)
    assert events(run, "run_started")[-1]["resumed_from"].endswith("global_step_4"), what
    verify = trainguard("ckpt", "verify", str(run))
    assert verify.returncode == 0, (what, verify.stdout)
