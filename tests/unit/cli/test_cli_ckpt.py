"""``trainguard ckpt list|verify`` on fake checkpoints with real manifests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.fs.layout import HEALTH_FILE, MANIFEST_NAME, extra_state_name, temp_dir_name
from trainguard.cli import main

from helpers.runs import make_checkpoint


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    root.mkdir()
    make_checkpoint(root, 4, health={"is_health": 0})
    make_checkpoint(root, 8)
    make_checkpoint(root, 12, world_size=4)
    (root / temp_dir_name(16)).mkdir()
    return tmp_path


def corrupt_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))


def list_json(capsys, *args: str) -> list[dict]:
    assert main(["ckpt", "list", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_list_json_reports_every_checkpoint(run_dir, capsys):
    (run_dir / "checkpoints" / HEALTH_FILE).write_text(
        json.dumps([{"is_health": 1, "ckpt_name": "global_step_8"}, {"is_health": 1, "ckpt_name": "global_step_4"}])
    )
    rows = list_json(capsys, str(run_dir))
    assert [(r["step"], r["committed"], r["verified"]) for r in rows] == [
        (4, True, True),
        (8, True, True),
        (12, True, True),
        (16, False, None),
    ]
    by_step = {r["step"]: r for r in rows}
    # The manifest's own health wins; health_ckpts.json fills in where the manifest has none.
    assert by_step[4]["health"] == "healthy"
    assert by_step[8]["health"] == "unhealthy"
    assert by_step[12]["health"] is None
    assert by_step[12]["world_size"] == 4
    assert by_step[12]["size_bytes"] == sum(
        p.stat().st_size for p in (run_dir / "checkpoints" / "global_step_12").rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    )
    assert isinstance(by_step[4]["created"], float) and by_step[4]["created_local"]
    assert by_step[16]["error"] == "incomplete (being written or abandoned)"


def test_list_table_and_no_verify(run_dir, capsys):
    corrupt_byte(run_dir / "checkpoints" / "global_step_8" / "__0_0.distcp")
    assert main(["ckpt", "list", str(run_dir / "checkpoints")]) == 0
    out = capsys.readouterr().out
    for header in ("step", "committed", "verified", "size", "world size", "created", "health"):
        assert header in out
    assert "healthy" in out and "__0_0.distcp: checksum mismatch" in out

    rows = list_json(capsys, str(run_dir), "--no-verify")
    assert [r["verified"] for r in rows] == [None, None, None, None]


def test_list_warns_about_a_broken_health_file(run_dir, capsys):
    (run_dir / "checkpoints" / HEALTH_FILE).write_text('{"not": "a list"}')
    assert main(["ckpt", "list", str(run_dir), "--json"]) == 0
    captured = capsys.readouterr()
    assert f"trainguard: warning: {run_dir / 'checkpoints' / HEALTH_FILE}: expected [" in captured.err
    assert json.loads(captured.out)[0]["health"] == "healthy"


def test_verify_all_good(run_dir, capsys):
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    assert capsys.readouterr().out.splitlines() == ["OK global_step_4", "OK global_step_8", "OK global_step_12"]


def test_verify_names_a_corrupted_file(run_dir, capsys):
    corrupt_byte(run_dir / "checkpoints" / "global_step_8" / "__0_0.distcp")
    (run_dir / "checkpoints" / "global_step_12" / extra_state_name(4, 3)).unlink()
    assert main(["ckpt", "verify", str(run_dir)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "OK global_step_4",
        "BAD global_step_8/__0_0.distcp: checksum mismatch",
        "BAD global_step_12/extra_state_world_size_4_rank_3.pt: missing",
    ]


def test_verify_one_step(run_dir, capsys):
    corrupt_byte(run_dir / "checkpoints" / "global_step_8" / "__0_0.distcp")
    assert main(["ckpt", "verify", str(run_dir), "--step", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == ["OK global_step_4"]
    assert main(["ckpt", "verify", str(run_dir), "--step", "8"]) == 1
    assert "BAD global_step_8/__0_0.distcp: checksum mismatch" in capsys.readouterr().out


def test_verify_missing_step_is_a_usage_error(run_dir, capsys):
    assert main(["ckpt", "verify", str(run_dir), "--step", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainguard: error: no checkpoint global_step_16 in ") and err.count("\n") == 1


def test_verify_reports_a_broken_manifest(run_dir, capsys):
    (run_dir / "checkpoints" / "global_step_8" / MANIFEST_NAME).write_text('{"format": "trainguard-checkpoint"}')
    assert main(["ckpt", "verify", str(run_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "BAD global_step_8/trainguard.json: missing key 'version'"


@pytest.mark.parametrize("command", ["list", "verify"])
def test_not_a_checkpoint_directory_is_a_one_line_usage_error(tmp_path, capsys, command):
    assert main(["ckpt", command, str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'absent'}: no such directory" in err and err.count("\n") == 1

    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("hello")
    assert main(["ckpt", command, str(tmp_path / "unrelated")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory or checkpoints root" in err and err.count("\n") == 1


def test_empty_checkpoints_root(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().err
    assert list_json(capsys, str(tmp_path)) == []


def test_verify_a_checkpoint_with_1500_nested_directories_is_one_bad_line(run_dir, capsys):
    """Issue 38 item 13: the walk is not recursive (a RecursionError traceback before) and its depth is bounded."""
    nested = [run_dir / "checkpoints" / "global_step_8" / "huggingface" / "d"]
    for _ in range(1499):
        nested.append(nested[-1] / "d")
    try:
        for directory in nested:
            directory.mkdir()
        assert main(["ckpt", "verify", str(run_dir), "--step", "8"]) == 1
    finally:  # bottom up: pytest's own clean-up (shutil.rmtree) recurses and would fail on this tree
        for directory in reversed(nested):
            if directory.exists():
                directory.rmdir()
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1 and captured.err == ""
    assert lines[0].startswith("BAD global_step_8/huggingface/d/d/")
    assert lines[0].endswith(": directories nested deeper than 64 levels")


def test_walk_entries_bounds_the_count_of_entries_read(tmp_path):
    from trainguard.fs.tree import TreeBoundError, walk_entries

    for name in "abcde":
        (tmp_path / name).write_text(name)
    assert [relative for relative, _, _ in walk_entries(tmp_path, max_entries=5)] == list("abcde")
    with pytest.raises(TreeBoundError, match="more than 4 entries"):
        list(walk_entries(tmp_path, max_entries=4))
