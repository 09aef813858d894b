"""A checkpoint whose files would run code when unpickled is refused; the code never runs, and the
refusal is one line from rank 0 (issue 24), never a traceback of every rank or a hang."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from trainguard.checkpoint.checksum import file_checksum
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.checkpoint.manifest import build_manifest, read_manifest, write_manifest
from trainguard.errors import UnsafeCheckpointError

from helpers.runs import events, ok, train


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _replant(ckpt_dir, name, payload) -> None:
    """Replaces one file with a malicious pickle and re-signs the manifest, as an attacker could."""
    (ckpt_dir / name).write_bytes(pickle.dumps(payload))
    old = read_manifest(ckpt_dir)
    (ckpt_dir / "trainguard.json").unlink()
    fresh = build_manifest(ckpt_dir, step=old.step, world_size=old.world_size, mesh_shape=old.mesh_shape,
                           mesh_dim_names=old.mesh_dim_names, trainer_state=old.trainer_state)
    write_manifest(ckpt_dir, fresh)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("trainguard: error:")]


PLANTED = {  # file, how the run resumes
    "DCP metadata, auto resume": (".metadata", "auto"),
    "a DCP shard, explicit resume": ("__0_0.distcp", "path"),
    "rank 0's extra state, auto resume": ("extra_state_world_size_2_rank_0.pt", "auto"),
    "rank 1's extra state, explicit resume": ("extra_state_world_size_2_rank_1.pt", "path"),
}


@pytest.mark.parametrize(("name", "resume"), PLANTED.values(), ids=PLANTED.keys())
def test_a_planted_pickle_is_refused_at_resume_in_one_line_from_rank_0(committed_run, tmp_path, name, resume):
    run = tmp_path / "run"
    shutil.copytree(committed_run, run)
    marker = tmp_path / "code-ran"
    ckpt = run / "checkpoints/global_step_8"
    _replant(ckpt, name, _Payload(marker))

    proc = train(run, 2, 10, "--save-interval", "4", "--resume", str(ckpt) if resume == "path" else "auto")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: [rank 0] "), proc.stderr[-3000:]
    assert "refusing to load" in lines[0] and name in lines[0], lines
    assert not marker.exists()


def test_planted_dcp_metadata_pickle_is_refused(committed_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(committed_run / "checkpoints/global_step_8", ckpt)
    marker = tmp_path / "code-ran"
    _replant(ckpt, ".metadata", _Payload(marker))
    with pytest.raises(UnsafeCheckpointError, match=".metadata"):
        read_full_state_dict(ckpt)
    assert not marker.exists()


LOCAL = ["--save-interval", "4", "--set", "checkpoint.local_interval=2"]


def test_a_planted_pickle_in_a_local_tier_file_is_passed_over(tmp_path):
    """One rank's local-tier file of the newest step replaced by a code-running pickle, its rank
    manifest re-signed: that rank refuses it, every rank passes the step over (no rank is left waiting
    for the others) and the run resumes from the durable checkpoint."""
    run = tmp_path / "run"
    ok(train(run, 2, 6, *LOCAL))
    marker = tmp_path / "code-ran"
    local_step = run / "local/node0/global_step_6"
    planted = local_step / "extra_state_world_size_2_rank_1.pt"
    planted.write_bytes(pickle.dumps(_Payload(marker)))
    rank_manifest = local_step / "manifest_world_size_2_rank_1.json"
    data = json.loads(rank_manifest.read_text())
    for entry in data["files"]:
        if Path(entry["path"]).name == planted.name:
            entry.update(size=planted.stat().st_size, checksum=file_checksum(planted))
    rank_manifest.write_text(json.dumps(data))
    shutil.rmtree(run / "checkpoints/global_step_6")  # the durable copy of step 6 would win the tie anyway

    proc = train(run, 2, 8, *LOCAL, "--resume", "auto", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output
    assert f"local step 6 passed over: refusing to load {planted}" in output, output[-3000:]
    assert events(run, "run_started")[-1]["resumed_from"].endswith("checkpoints/global_step_4")
    assert not marker.exists()
