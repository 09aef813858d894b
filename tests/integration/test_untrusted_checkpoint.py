"""A checkpoint whose files would run code when unpickled is refused; the code never runs."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.checkpoint.manifest import build_manifest, read_manifest, write_manifest
from trainguard.errors import UnsafeCheckpointError

from helpers.runs import train


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


def test_planted_extra_state_pickle_is_refused_at_resume(committed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(committed_run, run)
    marker = tmp_path / "code-ran"
    ckpt = run / "checkpoints/global_step_8"
    _replant(ckpt, "extra_state_world_size_2_rank_0.pt", _Payload(marker))

    proc = train(run, 2, 10, "--save-interval", "4", "--resume", str(ckpt))
    assert proc.returncode != 0
    assert "refusing to load" in proc.stderr and "extra_state_world_size_2_rank_0.pt" in proc.stderr
    assert not marker.exists()


def test_planted_dcp_metadata_pickle_is_refused(committed_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(committed_run / "checkpoints/global_step_8", ckpt)
    marker = tmp_path / "code-ran"
    _replant(ckpt, ".metadata", _Payload(marker))
    with pytest.raises(UnsafeCheckpointError, match=".metadata"):
        read_full_state_dict(ckpt)
    assert not marker.exists()
