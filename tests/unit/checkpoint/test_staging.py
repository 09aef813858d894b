"""Async-save staging (buffers reused across saves, independent of the live tensors) and the writer that
hashes DCP shards as it writes them."""

from __future__ import annotations

import collections
import os
import random
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers.forked_ranks import run_forked_ranks
from trainguard.checkpoint.checksum import file_checksum
from trainguard.checkpoint.dcp_writer import ChecksummingFileSystemWriter, SerializeOnceSavePlanner
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.checkpoint.hashing_file import HashingFile
from trainguard.checkpoint.staging import ReusableStager, is_immutable

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": {"w": torch.randn(3, 5), "b": torch.zeros(5, dtype=torch.bfloat16), "t": base.t()},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 5)}},
            "param_groups": [{"lr": 0.1, "params": ["w", "b"], "betas": (0.9, 0.95)}],
        },
    }


def _flat_tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {}
    out = {}
    for key, value in items:
        out.update(_flat_tensors(value, f"{prefix}/{key}"))
    return out


def test_staged_copy_equals_the_state_and_is_independent_of_it():
    state = _state()
    expected = {k: v.clone() for k, v in _flat_tensors(state).items()}
    stager = ReusableStager()
    staged = stager.stage(state)
    assert staged["optim"]["param_groups"] == state["optim"]["param_groups"]
    # the next optimizer step mutates every tensor in place, and user code may edit the plain values
    for tensor in _flat_tensors(state).values():
        tensor.add_(1)
    state["optim"]["param_groups"][0]["params"].append("x")
    for key, tensor in _flat_tensors(staged).items():
        assert tensor.device.type == "cpu" and tensor.dtype == expected[key].dtype
        assert torch.equal(tensor, expected[key]), key
    assert staged["optim"]["param_groups"][0]["params"] == ["w", "b"]
    assert isinstance(staged["optim"]["param_groups"][0]["betas"], tuple)


def test_buffers_are_reused_while_the_layout_is_unchanged_and_reallocated_when_it_changes():
    state = _state()
    stager = ReusableStager()
    first = {k: v.data_ptr() for k, v in _flat_tensors(stager.stage(state)).items()}
    assert stager.allocations == 1
    assert stager.nbytes == sum(t.nbytes for t in _flat_tensors(state).values())
    for tensor in _flat_tensors(state).values():
        tensor.mul_(2)
    staged = stager.stage(state)
    assert stager.allocations == 1
    assert {k: v.data_ptr() for k, v in _flat_tensors(staged).items()} == first
    for key, tensor in _flat_tensors(state).items():
        assert torch.equal(_flat_tensors(staged)[key], tensor), key

    state["model"]["w"] = torch.randn(4, 5)  # a shape changes: a new buffer set
    staged = stager.stage(state)
    assert stager.allocations == 2
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    stager.close()
    assert stager.nbytes == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_buffers_are_not_pinned_without_cuda():
    staged = ReusableStager().stage(_state())
    assert not any(t.is_pinned() for t in _flat_tensors(staged).values())


def test_writer_writes_dcp_layout_and_hashes_what_it_wrote(tmp_path):
    """The shard is byte for byte what DCP's writer produces (with zip CRC32s off), so DCP's reader
    reads it, and the checksum taken while writing is the file's."""
    state = _state()
    ours = ChecksummingFileSystemWriter(tmp_path / "ours")
    previous = torch.serialization.get_crc32_options()
    # process-wide here only so that DCP's writer (and the planner's torch.save of non-tensor values)
    # match; ChecksummingFileSystemWriter leaves CRC32s out of tensor records by itself
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(state, storage_writer=ours, no_dist=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(previous)
    assert (tmp_path / "ours" / "__0_0.distcp").read_bytes() == (tmp_path / "dcp" / "__0_0.distcp").read_bytes()
    assert list(ours.written) == ["__0_0.distcp"]
    entry = ours.written["__0_0.distcp"]
    assert entry.size == os.path.getsize(tmp_path / "ours" / "__0_0.distcp")
    assert entry.checksum == file_checksum(tmp_path / "ours" / "__0_0.distcp")
    loaded = read_full_state_dict(tmp_path / "ours")
    assert torch.equal(loaded["model.t"], state["model"]["t"])
    assert torch.equal(loaded["optim.state.w.exp_avg"], state["optim"]["state"]["w"]["exp_avg"])


def test_serializing_equal_values_once_changes_no_byte(tmp_path):
    """The save planner serializes each distinct non-tensor value once; the shard is the same bytes."""
    state = _state()
    groups = state["optim"]["param_groups"]
    groups += [{"lr": 0.1, "params": ["t"], "betas": (0.9, 0.95)}, {"lr": 1, "params": [], "betas": (True, 0.95), "eps": 1.0, "foreach": True}]
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # only so the planner's torch.save of values matches
    try:
        dcp.save(state, storage_writer=ChecksummingFileSystemWriter(tmp_path / "once"),
                 planner=SerializeOnceSavePlanner(), no_dist=True)
        dcp.save(state, storage_writer=ChecksummingFileSystemWriter(tmp_path / "each"), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(previous)
    assert (tmp_path / "once" / "__0_0.distcp").read_bytes() == (tmp_path / "each" / "__0_0.distcp").read_bytes()
    loaded = read_full_state_dict(tmp_path / "once")
    values = {key: value for key, value in loaded.items() if key.startswith("optim.param_groups")}
    # 1, 1.0 and True are equal in Python, yet each is read back as itself
    for key in ("lr", "eps", "foreach", "betas"):
        assert repr(values[f"optim.param_groups.2.{key}"]) == repr(groups[2][key])
    assert [values[f"optim.param_groups.{i}.betas"] for i in range(3)] == [group["betas"] for group in groups]


def test_hashing_file_coalesces_small_writes_in_order(tmp_path):
    path = tmp_path / "f"
    stream = HashingFile(path)
    chunks = [b"a" * 10, bytes(range(256)) * 300, b"b" * 3, os.urandom(5 << 20), b"c" * 7, b"d" * 70_000]
    for chunk in chunks:
        assert stream.write(chunk) == len(chunk)
    assert stream.tell() == sum(map(len, chunks))
    size, checksum = stream.close_durably()
    assert path.read_bytes() == b"".join(chunks)
    assert (size, checksum) == (os.path.getsize(path), file_checksum(path))


def _memory_dir(tmp_path: Path) -> Path:
    """A directory in node memory (tmpfs), where files are written through the page cache."""
    directory = Path("/dev/shm") / f"trainguard-test-{os.getpid()}-{tmp_path.name}"
    directory.mkdir()
    return directory


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_hashing_file_writes_every_byte_directly_or_through_the_page_cache(tmp_path, where):
    """Direct writes (``O_DIRECT`` through an aligned buffer, the last block padded then cut off) give
    the bytes written through the page cache, whatever the sizes, flushes, and a switch to raw access
    (``fileno``) midway; tmpfs files are never written directly."""
    directory = tmp_path if where == "disk" else _memory_dir(tmp_path)
    rng = random.Random(0)
    sizes = [1, 7, 4095, 4096, 5000, 70_000, 1 << 20, (8 << 20) + 3, 9 << 20, 100]
    try:
        for trial in range(12):
            path = directory / f"f{trial}"
            stream = HashingFile(path)
            assert stream.direct == (where == "disk")  # the disk case does write directly (tmp_path: ext4 here)
            chunks = [os.urandom(rng.choice(sizes)) for _ in range(rng.randint(0, 10))]
            for index, chunk in enumerate(chunks):
                assert stream.write(chunk) == len(chunk)
                if rng.random() < 0.3:
                    stream.flush()
                if trial == 5 and index == len(chunks) // 2:
                    stream.fileno()
                    assert not stream.direct  # raw access: every pending byte is in the file
            size, checksum = stream.close_durably()
            assert path.read_bytes() == b"".join(chunks), trial
            assert (size, checksum) == (os.path.getsize(path), file_checksum(path))
    finally:
        if where == "memory":
            shutil.rmtree(directory)


def test_a_direct_write_the_file_system_refuses_goes_through_the_page_cache_with_every_byte(tmp_path, monkeypatch):
    """A file system that takes ``O_DIRECT`` at open and refuses the write (EINVAL): the buffered bytes
    and the rest of the file go through the page cache, in place, the same bytes and checksum."""
    import errno
    import fcntl

    write_out = HashingFile._write_out

    def refusing(self, view):
        if fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        write_out(self, view)

    monkeypatch.setattr(HashingFile, "_write_out", refusing)
    rng = random.Random(1)
    for trial, sizes in enumerate([[10, 9 << 20, 5], [(8 << 20) + 1, 100], [3, 5000], [70_000]]):
        path = tmp_path / f"f{trial}"
        stream = HashingFile(path)
        assert stream.direct
        chunks = [rng.randbytes(size) for size in sizes]
        for chunk in chunks:
            stream.write(chunk)
        # flush waits for a full buffer's write in flight (refused on the writer thread) or makes its own
        stream.flush()
        assert stream.direct == (sum(sizes) < 4096)  # left direct writes at its first refused write
        size, checksum = stream.close_durably()
        assert path.read_bytes() == b"".join(chunks), trial
        assert (size, checksum) == (os.path.getsize(path), file_checksum(path))


def test_a_full_buffer_is_written_directly_while_the_caller_fills_the_next(tmp_path, monkeypatch):
    """Double buffering: the direct write of a full aligned buffer (which lasts as long as the device
    takes) runs on the writer thread, and ``write`` returns while it is still in flight; the bytes and
    checksum are the same."""
    import fcntl
    import threading

    write_out = HashingFile._write_out
    started, release = threading.Event(), threading.Event()
    writers = []

    def held_direct_write(self, view):
        if fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_DIRECT:
            writers.append(threading.current_thread())
            started.set()
            if threading.current_thread() is not threading.main_thread():  # the caller's own write: not held
                release.wait(timeout=60)
        write_out(self, view)

    monkeypatch.setattr(HashingFile, "_write_out", held_direct_write)
    path = tmp_path / "f"
    stream = HashingFile(path)
    assert stream.direct
    first = os.urandom((8 << 20) + (1 << 20))  # one full buffer, and a part of the next
    stream.write(first)
    assert started.wait(timeout=60) and not release.is_set()  # returned with the full buffer's write held
    assert writers[0] is not threading.main_thread()
    release.set()
    rest = os.urandom(5000)
    stream.write(rest)
    size, checksum = stream.close_durably()
    assert path.read_bytes() == first + rest
    assert (size, checksum) == (os.path.getsize(path), file_checksum(path))


# --- two ranks: FSDP2 DTensors, an async save, the live state mutated right after save() returns ---


def _two_rank_async_save(rank: int, world: int, store_path: str, root: str, result_dir: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from trainguard.checkpoint.durable import DurableCheckpointer
        from trainguard.checkpoint.manifest import read_manifest, verify_checkpoint
        from trainguard.events import EventLog

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

        def train_step() -> None:
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        def snapshot() -> dict[str, torch.Tensor]:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            flat = _flat_tensors({"model": model_sd, "optim": optim_sd})
            return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in flat.items()}

        train_step()
        checkpointer = DurableCheckpointer(
            Path(root), rank=rank, world_size=world, mesh_shape=[world], mesh_dim_names=["dp_shard"],
            run_token="t", process_group=dist.new_group(backend="gloo"), async_save=True, keep_last=5,
            keep_every=None, events=EventLog(Path(root) / f"events{rank}.jsonl", rank=rank, host="h"),
        )
        pointers = []
        for step in (1, 2):
            before = snapshot()
            checkpointer.save(step, model, optimizer, {"step": step}, {"step": step}, lambda d: None)
            pointers.append([t.data_ptr() for t in _flat_tensors(checkpointer.capture.stager._buffers).values()])
            train_step()  # mutates every parameter and optimizer state in place while the save writes
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1000.0)
            checkpointer.wait()
            dist.barrier()
            ckpt = Path(root) / f"global_step_{step}"
            saved = read_full_state_dict(ckpt)
            for key, value in before.items():
                name = key.strip("/").replace("/", ".")
                assert torch.equal(saved[name], value), f"step {step}: {name} differs from the state at save()"
            if rank == 0:
                assert verify_checkpoint(ckpt) == []
                names = {entry.path for entry in read_manifest(ckpt).files}
                assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= names
                assert {f"extra_state_world_size_2_rank_{r}.pt" for r in range(world)} <= names
        assert checkpointer.capture.stager.allocations == 1
        assert pointers[0] == pointers[1]
        dist.barrier()
        dist.destroy_process_group()
        Path(result_dir, f"ok{rank}").write_text("ok")
    except BaseException:
        Path(result_dir, f"error{rank}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def test_async_save_on_two_ranks_writes_the_state_at_save_time_and_reuses_buffers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    run_forked_ranks(_two_rank_async_save, 2, (2, str(tmp_path / "store"), str(tmp_path / "ckpts"), str(results)),
                     results)


def test_immutable_values_are_told_from_ones_a_staged_copy_could_see_change():
    assert is_immutable(random.getstate())  # (version, a tuple of 625 ints, None)
    assert is_immutable((1, 2.5, "a", None, torch.float32, (torch.Size([2]), (True, b"x"))))
    assert not is_immutable((1, [2]))
    assert not is_immutable((1, (2, (3, {"a": 1}))))
    assert not is_immutable((torch.zeros(1),))
    assert not is_immutable(collections.namedtuple("Pair", "a b")(1, 2))
    assert not is_immutable(((1,), (2, [3])))
