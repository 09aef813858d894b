"""File-level checkpoint primitives: layout, atomic writes, manifests, retention, discovery, safe loads."""

from __future__ import annotations

import builtins
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from trainguard.checkpoint import checksum
from trainguard.fs import fsio
from trainguard.checkpoint.checksum import checksum_matches, file_checksum
from trainguard.checkpoint.discovery import (
    INCOMPLETE,
    checkpoints_root,
    find_resume_checkpoint,
    list_checkpoints,
    read_latest,
    write_latest,
)
from trainguard.fs.fsio import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    clean_stale,
    commit_directory,
    remove_directory_crash_safe,
)
from trainguard.fs.layout import (
    LATEST_FILE,
    MANIFEST_NAME,
    extra_state_name,
    model_shard_name,
    optim_shard_name,
    parse_step_dir,
    parse_temp_dir,
    step_dir_name,
    temp_dir_name,
)
from trainguard.checkpoint.manifest import (
    BadFile,
    ManifestError,
    build_manifest,
    fields_checksum,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from trainguard.checkpoint.retention import select_for_deletion
from trainguard.checkpoint.safe_load import load_dcp_metadata, safe_torch_load
from trainguard.errors import CheckpointError, UnsafeCheckpointError

from helpers.runs import make_checkpoint

# DCP warns that it saves in a single process when no process group exists: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- layout ---------------------------------------------------------------------------------------


def test_step_dir_names_round_trip_and_only_exact_names_parse():
    assert step_dir_name(8) == "global_step_8"
    assert parse_step_dir("global_step_8") == 8
    assert parse_step_dir("global_step_0") == 0
    for name in ("global_step_08", "global_step_", "global_step_-1", "global_step_8.tmp-ab12", "xglobal_step_8",
                 "global_step_8 ", ".trash-global_step_8-ab12", "global_step8"):
        assert parse_step_dir(name) is None, name
    with pytest.raises(ValueError):
        step_dir_name(-1)


def test_temp_dir_names_are_distinct_per_writer_and_parse_back():
    first, second = temp_dir_name(12), temp_dir_name(12)
    assert first != second and first.startswith("global_step_12.tmp-")
    assert temp_dir_name(12, "cafe") == "global_step_12.tmp-cafe"
    assert parse_temp_dir(first) == 12
    assert parse_temp_dir("global_step_12") is None


def test_per_rank_file_names_match_verl():
    assert extra_state_name(4, 3) == "extra_state_world_size_4_rank_3.pt"
    assert model_shard_name(4, 3) == "model_world_size_4_rank_3.pt"
    assert optim_shard_name(4, 3) == "optim_world_size_4_rank_3.pt"


# --- fsio -----------------------------------------------------------------------------------------


def test_atomic_writes_replace_content_and_leave_no_temp_files(tmp_path):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    atomic_write_text(tmp_path / "t.txt", "héllo")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo"
    atomic_write_json(tmp_path / "j.json", {"a": [1, 2]})
    assert json.loads((tmp_path / "j.json").read_text()) == {"a": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "j.json", "t.txt"]


def test_failed_atomic_write_keeps_old_content(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(fsio.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_commit_directory_renames_and_never_replaces(tmp_path):
    temp = tmp_path / temp_dir_name(5)
    temp.mkdir()
    (temp / "a").write_text("x")
    final = tmp_path / step_dir_name(5)
    commit_directory(temp, final)
    assert (final / "a").read_text() == "x" and not temp.exists()

    again = tmp_path / temp_dir_name(5)
    again.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        commit_directory(again, final)
    assert again.exists() and (final / "a").exists()

    empty_final = tmp_path / step_dir_name(6)
    empty_final.mkdir()
    with pytest.raises(CheckpointError, match=str(empty_final)):
        commit_directory(again, empty_final)


def test_remove_directory_crash_safe_leaves_only_trash_on_crash(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, 3)
    remove_directory_crash_safe(tmp_path / "global_step_3")
    assert list(tmp_path.iterdir()) == []

    make_checkpoint(tmp_path, 4)

    def crash_midway(path):
        (Path(path) / "__0_0.distcp").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(fsio, "remove_tree", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        remove_directory_crash_safe(tmp_path / "global_step_4")
    monkeypatch.undo()
    (leftover,) = tmp_path.iterdir()
    assert leftover.name.startswith(".trash-global_step_4-")
    assert list_checkpoints(tmp_path) == []
    assert clean_stale(tmp_path) == [leftover]
    assert list(tmp_path.iterdir()) == []


def nested_directories(top: Path, depth: int) -> None:
    """``top/d/d/.../d``, ``depth`` levels, made one mkdir at a time (``mkdir(parents=True)`` recurses)."""
    nested = [top]
    for _ in range(depth - 1):
        nested.append(nested[-1] / "d")
    for directory in nested:
        directory.mkdir()
    (nested[-1] / "leaf.bin").write_bytes(b"x")
    outside = top.parent / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "kept").write_text("x")
    os.symlink(outside, nested[-2] / "link")  # removed, never followed


def test_a_directory_1500_levels_deep_is_removed_crash_safely_and_as_a_stale_leftover(tmp_path):
    """Issue 38 item 13: shutil.rmtree recurses, a RecursionError on a tree this deep (a hostile
    checkpoint replaced, or its temp copy left behind); the removal walks it without recursion."""
    nested_directories(tmp_path / "global_step_5", 1500)
    remove_directory_crash_safe(tmp_path / "global_step_5")
    leftover = tmp_path / temp_dir_name(6)
    nested_directories(leftover, 1500)
    assert clean_stale(tmp_path) == [leftover]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]
    assert (tmp_path / "outside" / "kept").read_text() == "x"


def test_clean_stale_removes_only_transient_entries(tmp_path):
    make_checkpoint(tmp_path, 2)
    write_latest(tmp_path, 2)
    stale = [
        tmp_path / temp_dir_name(4),
        tmp_path / ".trash-global_step_1-ab12",
    ]
    for directory in stale:
        (directory / "sub").mkdir(parents=True)
    stale_file = tmp_path / f"{LATEST_FILE}.tmp-0bad"
    stale_file.write_text("4")
    assert clean_stale(tmp_path) == sorted([*stale, stale_file])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", LATEST_FILE]


# --- checksum -------------------------------------------------------------------------------------


def test_file_checksum_is_xxh3_64_over_many_buffers(tmp_path, monkeypatch):
    data = os.urandom(10_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    monkeypatch.setattr(checksum, "_BUFFER_SIZE", 1024)
    expected = f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"
    assert file_checksum(path) == expected
    assert len(expected.split(":")[1]) == 16
    assert checksum_matches(path, expected)
    flip_byte(path, 9_999)
    assert not checksum_matches(path, expected)
    with pytest.raises(ValueError, match="unsupported checksum"):
        checksum_matches(path, "sha256:00")


# --- manifest -------------------------------------------------------------------------------------


def test_manifest_round_trip_lists_every_file_but_itself(tmp_path):
    ckpt = make_checkpoint(tmp_path, 7)
    built = build_manifest(
        ckpt,
        step=7,
        world_size=2,
        mesh_shape=[2],
        mesh_dim_names=["dp_shard"],
        trainer_state={"step": 7, "consumed_samples": 56},
        health={"is_health": 0, "embedding_local_norm": 0.5},
        extra={"roles": ["actor"]},
    )
    write_manifest(ckpt, built)
    manifest = read_manifest(ckpt)
    assert manifest == built
    assert [f.path for f in manifest.files] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "extra_state_world_size_2_rank_0.pt",
        "extra_state_world_size_2_rank_1.pt",
        "huggingface/config.json",
    ]
    assert manifest.files[1].size == 3000
    assert manifest.files[1].checksum == file_checksum(ckpt / "__0_0.distcp")
    assert manifest.format == "trainguard-checkpoint" and manifest.version == 2
    assert manifest.step == 7 and manifest.world_size == 2 and manifest.health["is_health"] == 0
    assert manifest.trainer_state == {"step": 7, "consumed_samples": 56}
    assert manifest.total_size == sum(f.size for f in manifest.files)
    raw = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert raw["format"] == "trainguard-checkpoint" and raw["files"][0].keys() == {"path", "size", "checksum"}


def _valid_manifest_dict(tmp_path: Path) -> dict:
    return json.loads((make_checkpoint(tmp_path, 1) / MANIFEST_NAME).read_text())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="verl"), "format is 'verl', expected 'trainguard-checkpoint'"),
        (lambda d: d.pop("format"), "missing key 'format'"),
        (lambda d: d.update(version=3), "version 3 is not supported"),
        (lambda d: d.pop("world_size"), "missing key 'world_size'"),
        (lambda d: d.update(step="1"), "key 'step' should be an integer, found a string"),
        (lambda d: d.update(step=True), "key 'step' should be an integer, found a boolean"),
        (lambda d: d.update(mesh_shape=[2, "x"]), "key 'mesh_shape[1]' should be an integer"),
        (lambda d: d.update(trainer_state=[]), "key 'trainer_state' should be an object, found a list"),
        (lambda d: d.update(health=1), "key 'health' should be an object or null"),
        (lambda d: d["files"][0].pop("size"), "missing key 'files[0].size'"),
        (lambda d: d["files"][1].update(checksum="md5:abc"), "key 'files[1].checksum' is 'md5:abc'"),
        (lambda d: d["files"][0].update(path="../../etc/passwd"), "not a normalized relative path"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "not a normalized relative path"),
        (lambda d: d["files"].append(dict(d["files"][0])), "twice"),
    ],
)
def test_read_manifest_names_file_and_fault(tmp_path, mutate, message):
    data = _valid_manifest_dict(tmp_path)
    mutate(data)
    data["manifest_checksum"] = fields_checksum(data)  # as a faulty writer would sign it
    path = tmp_path / "global_step_1" / MANIFEST_NAME
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError) as caught:
        read_manifest(path.parent)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
    assert isinstance(caught.value, CheckpointError)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "missing"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid UTF-8"),
        (b"[1, 2]", "expected a JSON object, found a list"),
    ],
)
def test_read_manifest_unreadable_files(tmp_path, content, message):
    ckpt = tmp_path / "global_step_1"
    ckpt.mkdir()
    if content is not None:
        (ckpt / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ManifestError, match=message) as caught:
        read_manifest(ckpt)
    assert str(ckpt / MANIFEST_NAME) in str(caught.value)


def test_verify_detects_missing_resized_corrupted_and_unexpected_files(tmp_path):
    ckpt = make_checkpoint(tmp_path, 3)
    assert verify_checkpoint(ckpt) == []
    manifest = read_manifest(ckpt)
    (ckpt / "__1_0.distcp").unlink()
    flip_byte(ckpt / "__0_0.distcp")
    with open(ckpt / "huggingface" / "config.json", "a") as f:
        f.write(" ")
    (ckpt / "stray.bin").write_bytes(b"?")
    assert verify_checkpoint(ckpt, manifest) == [
        BadFile("__0_0.distcp", "checksum mismatch"),
        BadFile("__1_0.distcp", "missing"),
        BadFile("huggingface/config.json", "size 24 != expected 23"),
        BadFile("stray.bin", "unexpected file"),
    ]


def test_verify_reports_progress_in_bytes(tmp_path):
    ckpt = make_checkpoint(tmp_path, 3)
    seen = []
    verify_checkpoint(ckpt, progress=seen.append)
    assert sum(seen) == read_manifest(ckpt).total_size


# --- retention ------------------------------------------------------------------------------------


def test_retention_example_from_long_runs():
    steps = list(range(100, 2100, 100))
    assert select_for_deletion(steps, keep_last=3, keep_every=1000) == [
        100, 200, 300, 400, 500, 600, 700, 800, 900, 1100, 1200, 1300, 1400, 1500, 1600,
    ]
    assert select_for_deletion(steps, keep_last=2, keep_every=None, protected={300}) == [
        s for s in steps if s not in (300, 1900, 2000)
    ]
    assert select_for_deletion([], keep_last=1) == []


def test_retention_rejects_bad_policy():
    with pytest.raises(ValueError, match="keep_last"):
        select_for_deletion([1, 2], keep_last=0)
    with pytest.raises(ValueError, match="keep_every"):
        select_for_deletion([1, 2], keep_last=1, keep_every=0)


@given(
    steps=st.lists(st.integers(0, 500), max_size=40),
    keep_last=st.integers(1, 8),
    keep_every=st.one_of(st.none(), st.integers(1, 60)),
    protected=st.sets(st.integers(0, 500), max_size=5),
)
def test_retention_policy_properties(steps, keep_last, keep_every, protected):
    deleted = select_for_deletion(steps, keep_last, keep_every, protected)
    assert deleted == sorted(set(deleted)) and set(deleted) <= set(steps)
    if steps:
        assert max(steps) not in deleted
    assert not set(deleted) & protected
    if keep_every is not None:
        assert all(step % keep_every for step in deleted)
    intermediate = sorted(
        s for s in set(steps) if s not in protected and (keep_every is None or s % keep_every)
    )
    kept_intermediate = [s for s in intermediate if s not in deleted]
    assert kept_intermediate == intermediate[-keep_last:]


# --- discovery ------------------------------------------------------------------------------------


def test_checkpoints_root_accepts_run_dir_or_root(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert checkpoints_root(tmp_path) == tmp_path / "checkpoints"
    assert checkpoints_root(tmp_path / "checkpoints") == tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'}: no such directory"):
        checkpoints_root(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoints_root(tmp_path / "file")


def _run_with_every_kind_of_entry(root: Path) -> None:
    make_checkpoint(root, 2)
    make_checkpoint(root, 4)
    broken = root / "global_step_6"
    broken.mkdir()
    (broken / MANIFEST_NAME).write_text("{")
    (root / temp_dir_name(8)).mkdir()
    (root / ".trash-global_step_1-ab").mkdir()
    (root / "global_step_9").write_text("a file, not a checkpoint")
    make_checkpoint(root, 10)
    (root / "global_step_10").rename(root / "global_step_12")  # its manifest says 10


def test_list_checkpoints_classifies_entries(tmp_path):
    _run_with_every_kind_of_entry(tmp_path)
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.committed) for i in infos] == [(2, True), (4, True), (6, False), (8, False), (12, False)]
    assert infos[0].manifest.step == 2 and infos[0].error is None
    assert infos[2].error.startswith(f"{MANIFEST_NAME}: not valid JSON")
    assert infos[3].error == INCOMPLETE and infos[3].being_written
    assert infos[4].error == f"{MANIFEST_NAME}: records step 10, not 12"


def test_find_resume_checkpoint_falls_back_and_names_the_bad_file(tmp_path):
    _run_with_every_kind_of_entry(tmp_path)
    make_checkpoint(tmp_path, 14)
    flip_byte(tmp_path / "global_step_14" / "__0_0.distcp")
    make_checkpoint(tmp_path, 16)
    (tmp_path / "global_step_16" / "__1_0.distcp").unlink()
    (tmp_path / "global_step_16" / ".metadata").unlink()
    warnings: list[str] = []
    found = find_resume_checkpoint(tmp_path, warn=warnings.append)
    assert found.step == 4 and found.committed
    assert warnings == [
        f"skipping checkpoint {tmp_path / 'global_step_16'}: .metadata: missing (and 1 more bad files)",
        f"skipping checkpoint {tmp_path / 'global_step_14'}: __0_0.distcp: checksum mismatch",
        f"skipping checkpoint {tmp_path / 'global_step_12'}: {MANIFEST_NAME}: records step 10, not 12",
        f"skipping checkpoint {tmp_path / 'global_step_6'}: {MANIFEST_NAME}: not valid JSON "
        "(Expecting property name enclosed in double quotes at line 1 column 2)",
    ]


def test_find_resume_checkpoint_honours_accept(tmp_path):
    make_checkpoint(tmp_path, 2, health={"is_health": 0})
    make_checkpoint(tmp_path, 4, health={"is_health": 1})
    warnings: list[str] = []

    def healthy_only(info):
        return "unhealthy" if info.manifest.health["is_health"] else None

    found = find_resume_checkpoint(tmp_path, accept=healthy_only, warn=warnings.append)
    assert found.step == 2
    assert warnings == [f"skipping checkpoint {tmp_path / 'global_step_4'}: unhealthy"]
    assert find_resume_checkpoint(tmp_path, accept=lambda info: "no", warn=warnings.append) is None


def test_find_resume_checkpoint_on_empty_root(tmp_path):
    (tmp_path / temp_dir_name(2)).mkdir()
    warnings: list[str] = []
    assert find_resume_checkpoint(tmp_path, warn=warnings.append) is None
    assert warnings == []


def test_latest_file_is_a_bare_step_number(tmp_path):
    assert read_latest(tmp_path) is None
    write_latest(tmp_path, 8)
    assert (tmp_path / LATEST_FILE).read_bytes() == b"8\n"
    assert read_latest(tmp_path) == 8
    (tmp_path / LATEST_FILE).write_bytes(b"global_step_8")
    with pytest.raises(CheckpointError, match=f"{tmp_path / LATEST_FILE}: expected a bare step number"):
        read_latest(tmp_path)


# --- safe loads -----------------------------------------------------------------------------------


class _CreatesMarker:
    """Unpickling this creates a file: the stand-in for arbitrary code in a hostile checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


def test_safe_torch_load_loads_tensors(tmp_path):
    path = tmp_path / extra_state_name(1, 0)
    torch.save({"rng": torch.get_rng_state(), "step": 3, "names": ["a"]}, path)
    loaded = safe_torch_load(path)
    assert loaded["step"] == 3 and torch.equal(loaded["rng"], torch.get_rng_state())


def test_safe_torch_load_refuses_code_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"x": _CreatesMarker(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to load {path}: it contains pickled code") as caught:
        safe_torch_load(path)
    assert "(io.open)" in str(caught.value)
    assert not marker.exists()


def test_safe_torch_load_reads_numpy_rng_state_and_nothing_else_numpy(tmp_path):
    import numpy

    path = tmp_path / "extra.pt"
    state = numpy.random.RandomState(7).get_state()  # what verl's extra state holds: a uint32 array
    torch.save({"rng": {"numpy": state}}, path)
    loaded = safe_torch_load(path)["rng"]["numpy"]
    assert loaded[0] == "MT19937" and numpy.array_equal(loaded[1], state[1]) and loaded[2:] == state[2:]
    marker = tmp_path / "marker"
    for name, value in (("objects", numpy.array([_CreatesMarker(marker)], dtype=object)),
                        ("floats", numpy.zeros(3))):  # only the uint32 dtype of an RNG state is allowed
        torch.save({"x": value}, tmp_path / f"{name}.pt")
        with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
            safe_torch_load(tmp_path / f"{name}.pt")
    assert not marker.exists()


def test_safe_torch_load_reads_dtensors_without_a_process_group(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from trainguard.checkpoint.local.state import mesh_as_seen_by

    # written as in a run (before torch 2.10 a mesh is built inside a process group), read offline
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = mesh_as_seen_by(torch.arange(4).reshape(2, 2), ("ddp", "fsdp"), 1)
        local = torch.arange(6.0).reshape(3, 2)
        torch.save({"w": DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                            shape=torch.Size([6, 2]), stride=(2, 1))}, tmp_path / "model.pt")
    finally:
        dist.destroy_process_group()
    loaded = safe_torch_load(tmp_path / "model.pt")["w"]
    assert loaded.device_mesh.mesh_dim_names == ("ddp", "fsdp") and loaded.placements == (Replicate(), Shard(0))
    assert loaded.shape == (6, 2) and torch.equal(loaded.to_local(), local)


def test_safe_torch_load_reports_damaged_files_as_unreadable(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"x": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=f"cannot load {path}") as caught:
        safe_torch_load(path)
    assert not isinstance(caught.value, UnsafeCheckpointError)
    with pytest.raises(CheckpointError, match="missing"):
        safe_torch_load(tmp_path / "absent.pt")


def _dcp_save(state: dict, directory: Path) -> None:
    dcp.save(state, checkpoint_id=directory, no_dist=True)


def test_load_dcp_metadata_reads_real_metadata(tmp_path):
    state = {"a": torch.randn(3), "n": 5, "s": {"x": torch.ones(2)}, "b": torch.zeros(2, 3, dtype=torch.bfloat16)}
    _dcp_save(state, tmp_path)
    metadata = load_dcp_metadata(tmp_path)
    assert set(metadata.state_dict_metadata) == {"a", "n", "s.x", "b"}
    assert metadata.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    assert load_dcp_metadata(tmp_path / ".metadata").state_dict_metadata.keys() == metadata.state_dict_metadata.keys()


def test_load_dcp_metadata_reads_dtensor_and_optimizer_metadata(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(3, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        state = {
            "sharded": distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]),
            "replicated": distribute_tensor(torch.randn(3), mesh, [Replicate()]),
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
        }
        dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    finally:
        dist.destroy_process_group()
    metadata = load_dcp_metadata(tmp_path / "ckpt")
    assert "sharded" in metadata.state_dict_metadata and "optim.state.0.exp_avg" in metadata.state_dict_metadata


def test_load_dcp_metadata_refuses_planted_code(tmp_path):
    _dcp_save({"a": torch.ones(2)}, tmp_path)
    marker = tmp_path / "marker"
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_CreatesMarker(marker), f)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*\.metadata: .*\(io\.open\)"):
        load_dcp_metadata(tmp_path)
    assert not marker.exists()


def test_load_dcp_metadata_refuses_code_nested_in_real_metadata(tmp_path):
    _dcp_save({"a": torch.ones(2)}, tmp_path)
    metadata = load_dcp_metadata(tmp_path)
    marker = tmp_path / "marker"
    metadata.planner_data = {"a": _CreatesMarker(marker)}
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError):
        load_dcp_metadata(tmp_path)
    assert not marker.exists()


def test_load_dcp_metadata_reports_damage_and_wrong_content(tmp_path):
    _dcp_save({"a": torch.ones(2)}, tmp_path)
    data = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot load") as caught:
        load_dcp_metadata(tmp_path)
    assert not isinstance(caught.value, UnsafeCheckpointError)
    (tmp_path / ".metadata").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="holds a list, not DCP Metadata"):
        load_dcp_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="missing"):
        load_dcp_metadata(tmp_path / "elsewhere")


def test_retention_after_resuming_behind_newer_checkpoints():
    from trainguard.checkpoint.retention import retention_after_commit

    # resumed from 20 past bad 30/40/50, now committing 25: the new timeline is kept, the old one left
    assert retention_after_commit([10, 20, 25, 30, 40, 50], 25, unhealthy=[], keep_last=2) == [10]
    # the newest healthy checkpoint survives a run of unhealthy ones
    assert retention_after_commit([2, 4, 6, 8], 8, unhealthy=[6, 8], keep_last=1) == [2, 6]
