"""Hostile and broken checkpoint files (issue 24): every kind of damage is named in one line and passed
over at resume; nothing is read through a link or from a FIFO; the tracker and the health file are
checked and repaired. Small synthetic checkpoints in the real layout (helpers.runs.make_checkpoint)."""

from __future__ import annotations

import json
import os
import random
import re
import stat
from pathlib import Path

import pytest

from trainguard.checkpoint.discovery import latest_fault, list_checkpoints, read_latest, write_latest
from trainguard.checkpoint.manifest import ManifestError, fields_checksum, read_manifest, verify_checkpoint
from trainguard.checkpoint.resume import choose_resume_checkpoint
from trainguard.checkpoint.trusted import require_verified
from trainguard.errors import CheckpointError
from trainguard.fs.layout import HEALTH_FILE, LATEST_FILE, MANIFEST_NAME

from helpers.runs import make_checkpoint, outside_file


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    make_checkpoint(root, 4)
    make_checkpoint(root, 8)
    write_latest(root, 8)
    return root


def _edit_manifest(ckpt: Path, edit, *, resign: bool = False) -> None:
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    edit(data)
    if resign:
        data["manifest_checksum"] = fields_checksum(data)
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))


def _resumes_from(root: Path) -> tuple[str, list[str]]:
    warnings: list[str] = []
    chosen = choose_resume_checkpoint("auto", root, warn=warnings.append)
    assert chosen is not None
    return chosen.name, warnings


MANIFEST_EDITS = {
    "world size 2->3": lambda d: d.update(world_size=3),
    "world size 2->1": lambda d: d.update(world_size=1),
    "mesh shape": lambda d: d.update(mesh_shape=[4]),
    "health": lambda d: d.update(health={"is_health": 0}),
    "step": lambda d: d.update(step=9),
    "a file's size": lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS.values(), ids=MANIFEST_EDITS.keys())
def test_an_edited_manifest_fails_its_own_checksum_and_is_passed_over(root, edit):
    _edit_manifest(root / "global_step_8", edit)
    with pytest.raises(ManifestError, match="manifest_checksum.*edited or damaged"):
        read_manifest(root / "global_step_8")
    name, warnings = _resumes_from(root)
    assert name == "global_step_4"
    assert any("global_step_8" in w and MANIFEST_NAME in w for w in warnings), warnings


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(world_size=3, mesh_shape=[3]), "extra_state_world_size_2_rank_0.pt but records world_size 3"),
        (lambda d: d.update(world_size=1, mesh_shape=[1]), "records world_size 1"),
        (lambda d: d.update(mesh_shape=[2, 2], mesh_dim_names=["a", "b"]), "does not multiply to world_size 2"),
        (lambda d: d.update(mesh_dim_names=[]), "differ in length"),
        (lambda d: d.update(world_size=0, mesh_shape=[]), "world_size is 0"),
        (lambda d: d["files"].pop(3), "no extra_state file of rank"),
        (lambda d: d["trainer_state"].update(step=7), "trainer_state.step 7"),
    ],
)
def test_a_resigned_manifest_whose_fields_contradict_its_files_is_refused(root, edit, message):
    _edit_manifest(root / "global_step_8", edit, resign=True)
    with pytest.raises(ManifestError, match=message):
        read_manifest(root / "global_step_8")
    assert _resumes_from(root)[0] == "global_step_4"


def test_a_version_1_manifest_without_checksum_still_reads(root):
    _edit_manifest(root / "global_step_8", lambda d: (d.pop("manifest_checksum"), d.update(version=1)))
    assert read_manifest(root / "global_step_8").step == 8
    assert verify_checkpoint(root / "global_step_8") == []


def _symlink_out(path: Path) -> None:
    path.unlink()
    path.symlink_to(outside_file())


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _device(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers


ENTRY_ADDITIONS = {
    "listed file replaced by a symlink": ("huggingface/config.json", _symlink_out, "not a regular file (symlink)"),
    "symlink added": ("huggingface/vocab.json", lambda p: p.symlink_to(outside_file()), "not a regular file (symlink)"),
    "symlink to a directory added": ("etc", lambda p: p.symlink_to(outside_file().parent), "not a regular file (symlink)"),
    "fifo added": ("pipe", _fifo, "not a regular file (fifo)"),
    "device added": ("null", _device, "not a regular file (device)"),
    "empty directory added": ("empty", lambda p: p.mkdir(), "unexpected directory"),
    "file added": ("notes.txt", lambda p: p.write_text("x"), "unexpected file"),
}


@pytest.mark.parametrize(("entry", "make", "reason"), ENTRY_ADDITIONS.values(), ids=ENTRY_ADDITIONS.keys())
def test_only_listed_regular_files_inside_a_checkpoint(root, entry, make, reason):
    ckpt = root / "global_step_8"
    make(ckpt / entry)
    bad = verify_checkpoint(ckpt)
    assert [(f.path, f.reason) for f in bad] == [(entry, reason)]
    with pytest.raises(CheckpointError, match=f"{re.escape(entry)}: {re.escape(reason)}.*refusing to read"):
        require_verified(ckpt)
    with pytest.raises(CheckpointError, match=entry):  # a role or model directory below it likewise
        require_verified(ckpt / "huggingface")
    name, warnings = _resumes_from(root)
    assert name == "global_step_4" and any(entry in w for w in warnings)


def test_a_directory_no_manifest_covers_must_hold_only_regular_files(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert require_verified(hf) == hf
    (hf / "model.safetensors").symlink_to(outside_file())
    with pytest.raises(CheckpointError, match="model.safetensors: not a regular file"):
        require_verified(hf)


DAMAGE = {
    "byte flip": lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 0xFF]) + p.read_bytes()[1:]),
    "truncation": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "deletion": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
@pytest.mark.parametrize("name", [".metadata", "__1_0.distcp", "extra_state_world_size_2_rank_1.pt",
                                  "huggingface/config.json", MANIFEST_NAME])
def test_every_kind_of_file_damaged_every_way_is_refused(root, name, damage):
    ckpt = root / "global_step_8"
    damage(ckpt / name)
    if (ckpt / MANIFEST_NAME).exists():  # without one it is no trainguard checkpoint (a verl one, say)
        with pytest.raises(CheckpointError, match=re.escape(name)):
            require_verified(ckpt)
    name_chosen, warnings = _resumes_from(root)
    assert name_chosen == "global_step_4" and warnings


TRACKER_GARBAGE = {
    "path": lambda p: p.write_text("../../etc"),
    "no such step": lambda p: p.write_text("999"),
    "negative": lambda p: p.write_text("-5"),
    "empty": lambda p: p.write_text(""),
    "binary": lambda p: p.write_bytes(os.urandom(32) + b"\xff"),
    "leading zero": lambda p: p.write_text("08"),
    "huge": lambda p: p.write_text("9" * 400),
    "symlink out of the run": lambda p: p.symlink_to(outside_file()),
    "directory": lambda p: p.mkdir(),
    "fifo": _fifo,
}


@pytest.mark.parametrize("garbage", TRACKER_GARBAGE.values(), ids=TRACKER_GARBAGE.keys())
def test_a_bad_tracker_is_named_and_rewritten_at_resume(root, garbage):
    tracker = root / LATEST_FILE
    tracker.unlink()
    garbage(tracker)
    fault = latest_fault(root, {4, 8})
    assert fault is not None and str(tracker) in fault and "\n" not in fault
    name, warnings = _resumes_from(root)
    assert name == "global_step_8"
    assert any(LATEST_FILE in w and "rewriting it to 8" in w for w in warnings), warnings
    assert tracker.is_file() and not tracker.is_symlink() and tracker.read_text() == "8\n"
    assert latest_fault(root, {4, 8}) is None


def test_a_directory_in_the_trackers_place_does_not_break_a_commit(root):
    tracker = root / LATEST_FILE
    tracker.unlink()
    tracker.mkdir()
    (tracker / "x").write_text("x")
    write_latest(root, 8)
    assert read_latest(root) == 8


@pytest.mark.parametrize("content", [b"not json", b"\xff\xfe", b"[" * 10000, b'[{"is_health": NaN, "ckpt_name": 1}]', b"{}"])
def test_a_garbage_health_file_is_a_warning_at_resume(root, content):
    (root / HEALTH_FILE).write_bytes(content)
    name, warnings = _resumes_from(root)
    assert name == "global_step_8"
    assert any(HEALTH_FILE in w and "manifests only" in w for w in warnings), warnings


def test_a_health_file_that_is_a_fifo_does_not_block(root):
    os.mkfifo(root / HEALTH_FILE)
    name, warnings = _resumes_from(root)
    assert name == "global_step_8" and any("not a regular file" in w for w in warnings)


def test_a_manifest_that_is_a_symlink_or_fifo_is_not_followed(root, tmp_path):
    ckpt = root / "global_step_8"
    (tmp_path / "elsewhere.json").write_text((ckpt / MANIFEST_NAME).read_text())
    (ckpt / MANIFEST_NAME).unlink()
    (ckpt / MANIFEST_NAME).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ManifestError, match="symbolic link"):
        read_manifest(ckpt)
    (ckpt / MANIFEST_NAME).unlink()
    os.mkfifo(ckpt / MANIFEST_NAME)
    with pytest.raises(ManifestError, match="not a regular file"):
        read_manifest(ckpt)
    assert [i.committed for i in list_checkpoints(root)] == [True, False]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_random_damage_never_passes_verification(root, seed):
    rng = random.Random(seed)
    ckpt = root / "global_step_8"
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(files)
        if not target.is_file():  # gone, or made a fifo by an earlier damage (reading it would block)
            continue
        data = bytearray(target.read_bytes())
        kind = rng.choice(["flip", "truncate", "extend", "symlink", "fifo"])
        if kind == "flip" and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(data))
        elif kind == "truncate":
            target.write_bytes(bytes(data[: rng.randrange(len(data) or 1)]))
        elif kind == "extend":
            target.write_bytes(bytes(data) + os.urandom(rng.randint(1, 64)))
        elif kind == "symlink":
            target.unlink()
            target.symlink_to(outside_file())  # a later damage writes through it: never a system file
        else:
            target.unlink()
            os.mkfifo(target)
    if verify_checkpoint_or_none(ckpt) == []:
        pytest.skip(f"seed {seed}: the damage happened to restore the original bytes")
    with pytest.raises(CheckpointError):
        require_verified(ckpt)
    assert _resumes_from(root)[0] == "global_step_4"


def verify_checkpoint_or_none(ckpt: Path):
    try:
        return verify_checkpoint(ckpt)
    except ManifestError:
        return None


def test_a_manifest_with_a_nan_loss_commits_and_verifies(tmp_path):
    # a step-0 save (or one after a skipped step) carries loss NaN in its trainer state
    ckpt = make_checkpoint(tmp_path, 0, trainer_state={"step": 0, "loss": float("nan")})
    assert verify_checkpoint(ckpt) == []


def _real_dcp(directory: Path) -> Path:
    """A real (tiny) DCP save: a tensor and a pickled value, as the trainer's checkpoints hold."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0), "note": {"step": 3}}, storage_writer=dcp.FileSystemWriter(directory),
             no_dist=True)
    return directory


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp", "..", ""])
def test_a_storage_entry_naming_a_file_elsewhere_is_refused_before_anything_is_opened(tmp_path, name):
    import pickle

    from trainguard.checkpoint.durable import read_full_state_dict
    from trainguard.checkpoint.safe_load import load_dcp_metadata
    from trainguard.merge.read_dcp import open_dcp

    ckpt = _real_dcp(tmp_path / "ckpt")
    assert read_full_state_dict(ckpt)["w"].tolist() == [0, 1, 2, 3, 4, 5]
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: a plain unpickle is fine here
    for info in metadata.storage_data.values():
        info.relative_path = name
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    for reader in (load_dcp_metadata, read_full_state_dict, open_dcp):  # resume, convert/backup, merge
        with pytest.raises(CheckpointError, match=f"names {re.escape(repr(name))}, not a file of this checkpoint"):
            reader(ckpt)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("planted", ["a plain pickle", "a torch.save stream"])
def test_a_code_running_shard_file_is_one_line_naming_it(tmp_path, planted):
    import io
    import pickle

    import torch

    from trainguard.checkpoint.durable import read_full_state_dict

    marker = tmp_path / "code-ran"
    ckpt = _real_dcp(tmp_path / "ckpt")
    shard = next(ckpt.glob("*.distcp"))
    if planted == "a plain pickle":
        shard.write_bytes(pickle.dumps(_Payload(marker)))
    else:
        stream = io.BytesIO()
        torch.save({"w": _Payload(marker)}, stream)
        shard.write_bytes(stream.getvalue())
    with pytest.raises(CheckpointError) as caught:
        read_full_state_dict(ckpt)
    text = str(caught.value)
    assert shard.name in text and "\n" not in text, text
    assert not marker.exists()


LOCAL_CONTROL_FILE_GARBAGE = {
    "symlink out of the run": (lambda p: p.symlink_to(outside_file()), "a symbolic link, not a regular file"),
    "fifo": (_fifo, "not a regular file"),
    "nested too deeply": (lambda p: p.write_text("[" * 100 + "]" * 100), "nested deeper than 64"),
    "not UTF-8": (lambda p: p.write_bytes(b"\xff\xfe{}"), "cannot read"),
}


@pytest.mark.parametrize(("make", "reason"), LOCAL_CONTROL_FILE_GARBAGE.values(), ids=LOCAL_CONTROL_FILE_GARBAGE.keys())
def test_local_tier_control_files_are_never_followed_or_waited_on(tmp_path, make, reason):
    from trainguard.checkpoint.local.rank_manifest import read_rank_manifest
    from trainguard.topology import read_group_info

    for name, read in (("group_info.json", read_group_info), ("manifest_world_size_2_rank_0.json", read_rank_manifest)):
        make(tmp_path / name)
        with pytest.raises(CheckpointError, match=re.escape(reason)) as caught:
            read(tmp_path / name)
        assert str(tmp_path / name) in str(caught.value) and "\n" not in str(caught.value)
