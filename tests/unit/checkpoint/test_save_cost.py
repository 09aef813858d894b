"""Issue 38 item 2 (save cost) without weakening durability: a synchronous save fsyncs each of the
checkpoint's files and directories exactly once, all before the publishing rename; the commit's seal
issues its fsyncs together (they share journal commits), and its failures still fail the commit; the
files of a checkpoint retention retired are deleted after a synchronous save returns, once it is out of
the namespace."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint.commit import seal
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import build_manifest, verify_checkpoint
from trainguard.fs import fsio


def trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def static_files_without_fsync(directory: Path) -> None:
    """A ``huggingface/`` writer that leaves the fsync to the commit, as any static-files writer may."""
    (directory / "huggingface").mkdir()
    (directory / "huggingface" / "config.json").write_text('{"model_type": "toy"}\n')


def test_a_sync_save_fsyncs_each_file_and_directory_once_all_before_the_publishing_rename(tmp_path, monkeypatch):
    model, optimizer = trained()
    manager = CheckpointManager(tmp_path, model, optimizer, config=CheckpointConfig(save_interval=0, writer="thread"),
                                async_save=False, keep_last=5, static_files=static_files_without_fsync)
    happened: list[tuple] = []
    real_fsync, real_rename = os.fsync, os.rename

    def recorded_fsync(fd):
        info = os.fstat(fd)
        real_fsync(fd)
        happened.append(("fsync", (info.st_dev, info.st_ino)))

    def recorded_rename(source, destination, *args, **kwargs):
        real_rename(source, destination, *args, **kwargs)
        happened.append(("rename", Path(destination)))

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "rename", recorded_rename)
    manager.save_durable(1)
    monkeypatch.undo()
    manager.close()
    root = tmp_path / "checkpoints"
    final = root / "global_step_1"
    assert verify_checkpoint(final) == []
    published = happened.index(("rename", final))
    inside = {path: os.lstat(path) for path in [final, *final.rglob("*")]}
    assert {path.relative_to(final).as_posix() for path in inside} >= {
        ".", ".metadata", "__0_0.distcp", "trainguard.json", "huggingface", "huggingface/config.json"}
    before = [what for kind, what in happened[:published] if kind == "fsync"]
    after = [what for kind, what in happened[published:] if kind == "fsync"]
    for path, info in inside.items():
        identity = (info.st_dev, info.st_ino)
        assert (before.count(identity), after.count(identity)) == (1, 0), path
    root_info = os.stat(root)
    assert (root_info.st_dev, root_info.st_ino) in after  # the rename itself made durable


def a_staged_directory(tmp_path: Path):
    staged = tmp_path / "global_step_3.tmp-ab12"
    (staged / "huggingface").mkdir(parents=True)
    for name in ("__0_0.distcp", ".metadata", "huggingface/config.json"):
        (staged / name).write_bytes(name.encode() * 100)
    manifest = build_manifest(staged, step=3, world_size=1, mesh_shape=[1], mesh_dim_names=["dp"], trainer_state={})
    return staged, manifest


def test_the_seal_issues_its_fsyncs_together(tmp_path, monkeypatch):
    staged, manifest = a_staged_directory(tmp_path)
    # 3 files, the manifest and 2 directories: each fsync waits until all 6 are under way (one after
    # the other, the first would wait in vain)
    together = threading.Barrier(6, timeout=10)
    real_fsync = os.fsync

    def gathered_fsync(fd):
        together.wait()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", gathered_fsync)
    seal(staged, manifest)
    monkeypatch.undo()
    assert verify_checkpoint(staged) == []


def test_a_failed_fsync_fails_the_seal(tmp_path, monkeypatch):
    staged, manifest = a_staged_directory(tmp_path)
    real_fsync = os.fsync

    def failing_for_metadata(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".metadata"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_for_metadata)
    with pytest.raises(OSError, match="Input/output error"):
        seal(staged, manifest)


def test_a_sync_save_returns_before_the_retired_checkpoint_is_deleted(tmp_path, monkeypatch):
    """Retention renames the oldest checkpoint out of the namespace inside the save; the fsync that
    makes the rename durable and the deletion of its files come after the save returned, in that order
    (a crash before the fsync brings the old checkpoint back whole, never half-deleted)."""
    model, optimizer = trained()
    manager = CheckpointManager(tmp_path, model, optimizer, config=CheckpointConfig(save_interval=0, writer="thread"),
                                async_save=False, keep_last=1)
    manager.save_durable(1)
    root = tmp_path / "checkpoints"
    root_identity = (os.stat(root).st_dev, os.stat(root).st_ino)
    happened: list[tuple] = []
    real_fsync, real_rename, real_remove_tree = os.fsync, os.rename, fsio.remove_tree
    deleting = threading.Event()

    def recorded_fsync(fd):
        info = os.fstat(fd)
        real_fsync(fd)
        happened.append(("fsync", (info.st_dev, info.st_ino), threading.get_ident()))

    def recorded_rename(source, destination, *args, **kwargs):
        real_rename(source, destination, *args, **kwargs)
        happened.append(("rename", Path(destination).name, threading.get_ident()))

    def held_remove_tree(path):
        deleting.wait(timeout=3)  # held until the test has looked (bounded: a save deleting inline resumes)
        happened.append(("remove_tree", Path(path).name, threading.get_ident()))
        real_remove_tree(path)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "rename", recorded_rename)
    monkeypatch.setattr(fsio, "remove_tree", held_remove_tree)
    manager.save_durable(2)
    returned = len(happened)
    names = sorted(path.name for path in root.iterdir())
    deleting.set()
    manager.close()  # waits for the deletion
    monkeypatch.undo()
    assert "global_step_1" not in names and "global_step_2" in names
    assert [name for name in names if name.startswith(".trash-global_step_1-")], names
    assert verify_checkpoint(root / "global_step_2") == []
    assert not [path.name for path in root.iterdir() if path.name.startswith(".trash")]
    (retired,) = [i for i, event in enumerate(happened) if event[0] == "rename" and event[1].startswith(".trash-")]
    assert retired < returned
    assert not [event for event in happened[retired:returned] if event[0] == "fsync"]  # nothing waited for after it
    (removed,) = [i for i, event in enumerate(happened) if event[0] == "remove_tree"]
    assert ("fsync", root_identity) in [event[:2] for event in happened[retired:removed]]
