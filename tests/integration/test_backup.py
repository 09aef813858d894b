"""Backups to object storage against a real S3-compatible server on 127.0.0.1 (moto, IAM enforced):
round trip to a bitwise-exact resume, a backup killed half-way, clear errors, background mirroring
during training, mirror retention."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers.runs import (TINY, assert_same_tensors, events, finish_session, flat_state, make_checkpoint, ok, outside_file,
                          read_json, start_train, trainguard, worker_env)
from helpers.ports import free_port
from helpers.s3_server import start_s3_server
from trainguard.backup import mirror as mirror_module
from trainguard.backup.mirror import delete_mirrored, list_mirrored, mirror_checkpoint
from trainguard.backup.retention_mirror import mirror_deletions
from trainguard.backup.throttle import Throttle
from trainguard.backup.restore import restore_checkpoint
from trainguard.backup.url import MirrorError, open_mirror
from trainguard.fs.layout import MANIFEST_NAME, step_dir_name
from trainguard.checkpoint.manifest import build_manifest, read_manifest, verify_checkpoint, write_manifest


@pytest.fixture(scope="session")
def s3():
    server = start_s3_server()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The good credentials and endpoint in this process's environment, as a user would set them."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3


@pytest.fixture
def cli(s3, monkeypatch, capsys):
    """Runs ``trainguard ARGS`` in this process (the real command, minus seconds of imports per call)
    with the server's environment, optionally overridden; returns (exit code, stdout, stderr)."""

    def run(*args: str, **env: str) -> tuple[int, str, str]:
        for name, value in s3.env(**env).items():
            monkeypatch.setenv(name, value)
        from trainguard.cli import main

        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def cli_env(s3, **overrides) -> dict[str, str]:
    return worker_env(**s3.env(**overrides))


def train_s3(s3, run_dir: Path, nproc: int, steps: int, *extra: str) -> subprocess.CompletedProcess:
    """The reference trainer with the server's credentials and endpoint in its environment."""
    return trainguard("train", "--nproc", str(nproc), "--steps", str(steps), "--run-dir", str(run_dir), *TINY, *extra,
                      env=cli_env(s3), timeout=600)


def url(s3, prefix: str) -> str:
    return f"s3://{s3.bucket}/{prefix}"


def big_checkpoint(root: Path, step: int, files: int, size: int) -> Path:
    """A committed checkpoint of ``files`` random files of ``size`` bytes each."""
    ckpt = root / step_dir_name(step)
    ckpt.mkdir(parents=True)
    for i in range(files):
        (ckpt / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    write_manifest(ckpt, build_manifest(ckpt, step=step, world_size=files, mesh_shape=[files],
                                        mesh_dim_names=["dp_shard"], trainer_state={"step": step}))
    return ckpt


def same_bytes(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# --------------------------------------------------------------------------------------- round trip
def test_backup_delete_restore_resume_is_bitwise_exact(s3, cli, committed_run, tmp_path):
    """Back up, verify, lose every local checkpoint, resume from the mirror: the run ends bitwise
    where the same run ends when it never lost them."""
    kept, lost = tmp_path / "kept", tmp_path / "lost"
    shutil.copytree(committed_run, kept)
    shutil.copytree(committed_run, lost)
    code, out, _ = cli("ckpt", "backup", str(lost), url(s3, "roundtrip"))
    assert code == 0 and "global_step_4: mirrored" in out and "global_step_8: mirrored" in out and "verified" in out
    code, out, _ = cli("ckpt", "backup", str(lost), url(s3, "roundtrip"))
    assert code == 0 and "global_step_8: already in the mirror" in out

    shutil.rmtree(lost / "checkpoints")
    keeping = start_train(kept, 2, 12, "--save-interval", "4")  # trains meanwhile (a bounded run: it ends by itself)
    ok(train_s3(s3, lost, 2, 12, "--save-interval", "4", "--resume", url(s3, "roundtrip")))
    ok(finish_session(keeping, 600, "the run that kept its checkpoints"))
    started = events(lost, "run_started")[-1]
    assert started["step"] == 8 and started["resumed_from"].endswith("global_step_8")
    assert assert_same_tensors(kept / "checkpoints" / "global_step_12", lost / "checkpoints" / "global_step_12") > 0


def test_restore_cli_gives_back_the_same_bytes(s3, cli, committed_run, tmp_path):
    assert cli("ckpt", "backup", str(committed_run), url(s3, "restore-cli"), "--step", "4")[0] == 0
    code, out, _ = cli("ckpt", "restore", url(s3, "restore-cli"), str(tmp_path / "fresh"))
    assert code == 0 and "global_step_4" in out and "verified" in out
    root = tmp_path / "fresh" / "checkpoints"
    same_bytes(committed_run / "checkpoints" / "global_step_4", root / "global_step_4")
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    assert cli("ckpt", "verify", str(tmp_path / "fresh"))[0] == 0
    code, _, err = cli("ckpt", "restore", url(s3, "restore-cli"), str(tmp_path / "other"), "--step", "8")
    assert code == 4 and "no complete global_step_8 in the mirror (complete steps: 4)" in err


def test_weights_only_backup_holds_the_model_tensors(s3, cli, committed_run, tmp_path):
    assert cli("ckpt", "backup", str(committed_run), url(s3, "weights"), "--step", "8", "--weights-only")[0] == 0
    code, out, _ = cli("ckpt", "restore", url(s3, "weights"), str(tmp_path / "w"))
    assert code == 0 and "weights only" in out
    ckpt = tmp_path / "w" / "checkpoints" / "global_step_8"
    assert read_manifest(ckpt).extra["weights_only"] is True
    assert not (ckpt / ".metadata").exists() and (ckpt / "huggingface" / "config.json").exists()
    weights = load_file(ckpt / "model.safetensors")
    full = flat_state(committed_run / "checkpoints" / "global_step_8")
    model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    assert weights.keys() == model.keys()
    assert all((weights[k] == model[k]).all() for k in weights)
    from trainguard.backup.restore import restore_for_resume
    from trainguard.errors import NoCheckpointError

    with pytest.raises(NoCheckpointError, match="weights-only backup cannot resume training"):
        restore_for_resume(url(s3, "weights/global_step_8"), tmp_path / "resume" / "checkpoints")


# ------------------------------------------------------------------------------- killed half-way
def test_backup_killed_half_way_leaves_nothing_complete_and_next_backup_finishes(s3_env, cli, tmp_path):
    s3 = s3_env
    root = tmp_path / "run" / "checkpoints"
    ckpt = big_checkpoint(root, 10, files=6, size=1 << 20)
    env = cli_env(s3)
    target = url(s3, "killed")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "ckpt", "backup", str(root), target,
                             "--bandwidth-mbps", "0.5", "--workers", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    mirror = open_mirror(target, s3.endpoint)
    deadline = time.monotonic() + 120
    try:
        while not mirror.fs.find(mirror.path("global_step_10"), refresh=True):
            assert proc.poll() is None, "the throttled backup finished before it could be killed"
            assert time.monotonic() < deadline
            mirror.fs.invalidate_cache()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        mirror.fs.invalidate_cache()
        left = mirror.fs.find(mirror.path("global_step_10"))
        assert left and len(left) < 7, left  # some data objects, and no manifest
        assert not any(path.endswith(MANIFEST_NAME) for path in left)
        assert list_mirrored(mirror) == {}
        code, _, err = cli("ckpt", "restore", target, str(tmp_path / "r"))
        assert code == 4 and "no complete healthy checkpoint" in err

        code, out, _ = cli("ckpt", "backup", str(root), target)
        reused = int(out.split("uploaded, ")[1].split(" file")[0])
        assert code == 0 and reused >= 1, out  # what the killed backup uploaded and verified is kept
        assert cli("ckpt", "restore", target, str(tmp_path / "r"))[0] == 0
        same_bytes(ckpt, tmp_path / "r" / "checkpoints" / "global_step_10")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("case", ["wrong credentials", "missing bucket", "unreachable endpoint"])
def test_mirror_errors_are_one_clear_line(s3, cli, committed_run, tmp_path, case):
    env, target, expected = {}, url(s3, "errors"), ""
    if case == "wrong credentials":
        env, expected = {"AWS_SECRET_ACCESS_KEY": "not-the-secret-0123456789"}, "access denied"
    elif case == "missing bucket":
        target, expected = "s3://no-such-bucket-here/x", "s3://no-such-bucket-here/x: the bucket does not exist"
    else:
        env, expected = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, "cannot reach the storage endpoint"
    for command in (["backup", str(committed_run), target], ["restore", target, str(tmp_path / "x")]):
        code, out, err = cli("ckpt", *command, **env)
        assert code == 1, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("trainguard: error: ") and expected in lines[0], err
        assert s3.secret not in err + out and "not-the-secret" not in err + out
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("override, key", [("checkpoint.mirror.url=nowhere", "checkpoint.mirror.url"),
                                           ("checkpoint.mirror.every=0", "checkpoint.mirror.every"),
                                           ("checkpoint.mirror.url=nosuchproto://x/y", "checkpoint.mirror.url")])
def test_bad_mirror_config_is_a_config_error(override, key):
    from trainguard.config import load_config
    from trainguard.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_training_goes_on_when_the_background_mirror_fails(s3, tmp_path):
    run = tmp_path / "run"
    proc = ok(train_s3(s3, run, 1, 4, "--save-interval", "2",
                       "--set", "checkpoint.mirror.url=s3://no-such-bucket-here/run"))
    failed = events(run, "mirror_failed")
    assert [e["step"] for e in failed] == [None, 2, 4]  # catching up on earlier checkpoints, then each commit
    assert all("s3://no-such-bucket-here/run: the bucket does not exist" in e["error"] for e in failed)
    assert [e["step"] for e in events(run, "checkpoint_committed")] == [2, 4]
    assert events(run, "run_finished")[0]["step"] == 4
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "not mirrored" in line]
    assert len(warnings) == 3 and s3.secret not in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- background mirroring
def test_background_mirror_uploads_every_mth_and_keeps_every_kth(s3_env, tmp_path):
    s3 = s3_env
    run = tmp_path / "run"
    target = url(s3, "background")
    ok(train_s3(s3, run, 1, 12, "--save-interval", "2", "--set", "checkpoint.keep_last=1",
                "--set", f"checkpoint.mirror.url={target}", "--set", "checkpoint.mirror.every=4",
                "--set", "checkpoint.mirror.keep_every=8"))
    mirrored = [e["step"] for e in events(run, "checkpoint_mirrored")]
    assert mirrored == [4, 8, 12]
    deleted = [e["step"] for e in events(run, "checkpoint_deleted") if e["tier"] == "mirror"]
    assert deleted == [4]
    in_mirror = list_mirrored(open_mirror(target))
    assert sorted(in_mirror) == [8, 12]
    local = read_manifest(run / "checkpoints" / "global_step_12")
    assert in_mirror[12].files == local.files


# ----------------------------------------------------------------------------- in-process details
def test_server_checksums_verify_single_and_multipart_uploads_without_read_back(s3_env, tmp_path, monkeypatch):
    monkeypatch.setattr(mirror_module, "PART_SIZE", 5 << 20)  # S3's smallest part: 12 MiB → 3 parts
    ckpt = tmp_path / step_dir_name(3)
    ckpt.mkdir()
    (ckpt / "big").write_bytes(os.urandom(12 << 20))
    (ckpt / "small").write_bytes(b"x" * 1000)
    write_manifest(ckpt, build_manifest(ckpt, step=3, world_size=1, mesh_shape=[1], mesh_dim_names=["w"],
                                        trainer_state={}))

    def no_read_back(*args):
        raise AssertionError("verified by reading back, not by ETag")

    monkeypatch.setattr(mirror_module, "remote_checksum", no_read_back)
    mirror = open_mirror(url(s3_env, "etag"))
    result = mirror_checkpoint(ckpt, mirror)
    assert result.files_uploaded == 2 and mirror.fs.info(mirror.path("global_step_3", "big"))["ETag"].endswith('-3"')
    assert list(list_mirrored(mirror)) == [3]
    # An object changed in the mirror (same size) no longer verifies: the next backup uploads it again.
    mirror.fs.pipe_file(mirror.path("global_step_3", "small"), b"y" * 1000)
    mirror.fs.rm_file(mirror.path("global_step_3", MANIFEST_NAME))
    again = mirror_checkpoint(ckpt, mirror)
    assert (again.files_uploaded, again.files_reused) == (1, 1)
    assert mirror.fs.cat_file(mirror.path("global_step_3", "small")) == b"x" * 1000


def test_corrupted_local_file_is_never_mirrored(s3_env, cli, tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = make_checkpoint(root, 5)
    make_checkpoint(root, 6)
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[10] ^= 1
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    code, out, err = cli("ckpt", "backup", str(root), url(s3_env, "corrupt"))
    assert code == 1 and "global_step_6: mirrored" in out
    assert err.strip() == f"trainguard: error: {ckpt / '__0_0.distcp'}: checksum does not match trainguard.json; not mirrored"
    assert list(list_mirrored(open_mirror(url(s3_env, "corrupt")))) == [6]


def test_redone_step_replaces_the_mirrored_copy_and_delete_removes_it(s3_env, tmp_path):
    mirror = open_mirror(url(s3_env, "redone"))
    first = make_checkpoint(tmp_path / "a", 6)
    mirror_checkpoint(first, mirror)
    second = make_checkpoint(tmp_path / "b", 6)  # same step, other bytes (a timeline redone)
    (second / "stale-free").write_bytes(b"new file")
    write_manifest(second, build_manifest(second, step=6, world_size=2, mesh_shape=[2], mesh_dim_names=["w"],
                                          trainer_state={}))
    result = mirror_checkpoint(second, mirror)
    assert not result.already_complete
    assert list_mirrored(mirror)[6].files == read_manifest(second).files
    delete_mirrored(mirror, 6)
    assert list_mirrored(mirror) == {} and not mirror.fs.find(mirror.path("global_step_6"))


def test_file_url_mirror_round_trip(tmp_path):
    ckpt = make_checkpoint(tmp_path / "src", 7)
    mirror = open_mirror(f"file://{tmp_path}/mirror")
    mirror_checkpoint(ckpt, mirror)
    assert not verify_checkpoint(tmp_path / "mirror" / "global_step_7")
    same_bytes(ckpt, tmp_path / "mirror" / "global_step_7")


@pytest.mark.parametrize("damage", ["listed file replaced by a symlink", "symlink added", "fifo added",
                                    "unlisted file added"])
def test_restore_refuses_a_mirrored_checkpoint_with_links_or_unlisted_entries(tmp_path, damage):
    ckpt = make_checkpoint(tmp_path / "src", 7)
    mirror = open_mirror(f"file://{tmp_path}/mirror")
    mirror_checkpoint(ckpt, mirror)
    mirrored = tmp_path / "mirror" / "global_step_7"
    listed = read_manifest(mirrored).files[0].path
    if damage == "listed file replaced by a symlink":
        target, entry = outside_file(), listed
        target.write_bytes((mirrored / listed).read_bytes())  # same bytes: only the link itself is wrong
        (mirrored / listed).unlink()
        (mirrored / listed).symlink_to(target)
    elif damage == "symlink added":
        entry = "extra.bin"
        (mirrored / entry).symlink_to(outside_file())
    elif damage == "fifo added":
        entry = "pipe"
        os.mkfifo(mirrored / entry)
    else:
        entry = "unlisted.bin"
        (mirrored / entry).write_bytes(b"not in the manifest")
    with pytest.raises(MirrorError, match=f"global_step_7/{entry}: .*refusing to restore"):
        restore_checkpoint(mirror, list_mirrored(mirror)[7], tmp_path / "restored")
    assert not (tmp_path / "restored").exists() or not any((tmp_path / "restored").iterdir())


def test_mirror_retention_keeps_multiples_newest_and_newest_healthy():
    assert mirror_deletions([2, 4, 6, 8, 10], None) == []
    assert mirror_deletions([2, 4, 6, 8, 10], 4) == [2, 6]
    assert mirror_deletions([2, 4, 6, 8, 10], 4, unhealthy=[10]) == [2, 6]
    assert mirror_deletions([2, 4, 6, 9, 10], 4, unhealthy=[9, 10]) == [2, 9]  # 6 is the newest healthy
    assert mirror_deletions([], 4) == []


def test_throttle_holds_the_average_rate():
    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    throttle = Throttle(1000, clock=lambda: now[0], sleep=sleep)
    for _ in range(10):
        throttle.consume(500)
    assert now[0] == pytest.approx(4.0)  # 5000 bytes at 1000 B/s, less the one-second burst
    assert Throttle(None).consume(10**9) is None


def test_durable_retention_keeps_checkpoints_waiting_for_their_upload(tmp_path):
    from trainguard.checkpoint.durable import DurableCheckpointer
    from trainguard.events import EventLog

    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    durable = DurableCheckpointer(tmp_path, rank=0, world_size=1, mesh_shape=[1], mesh_dim_names=["w"], run_token="t",
                                  process_group=None, async_save=False, keep_last=1, keep_every=None,
                                  events=EventLog(None), protected=lambda: {2})
    durable._apply_retention(6)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step_")) == \
        ["global_step_2", "global_step_6"]


def test_health_of_a_restored_checkpoint_is_recorded(s3_env, tmp_path):
    from trainguard.backup.restore import choose_mirrored, restore_checkpoint

    mirror = open_mirror(url(s3_env, "health"))
    mirror_checkpoint(make_checkpoint(tmp_path / "a", 2, health={"is_health": 0}), mirror)
    mirror_checkpoint(make_checkpoint(tmp_path / "a", 4, health={"is_health": 1}), mirror)
    chosen = choose_mirrored(list_mirrored(mirror), None, mirror.url)
    assert chosen.step == 2  # the newest healthy one
    restore_checkpoint(mirror, list_mirrored(mirror)[4], tmp_path / "b")
    assert read_json(tmp_path / "b" / "health_ckpts.json") == [{"is_health": 1, "ckpt_name": "global_step_4"}]
    assert json.loads((tmp_path / "b" / "global_step_4" / MANIFEST_NAME).read_text())["health"]["is_health"] == 1


# ------------------------------------------------------------------------------ rollback and mirror
ROLLBACK = ["--set", "guards.check_for_global_norm=true", "--set", "guards.skip.threshold=10.0",
            "--set", "guards.rollback.window_before=1", "--set", "guards.rollback.window_after=1"]


def _tiny_manager(run_dir: Path, target: str):
    import torch

    from trainguard.backup.attach import attach_mirror
    from trainguard.backup.config import MirrorConfig
    from trainguard.checkpoint.manager import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(run_dir, model, optimizer, async_save=False, keep_last=10,
                                mirror=MirrorConfig(url=target))
    attach_mirror(manager)
    return manager, model


@pytest.mark.parametrize("in_flight", ["finishes", "loses its files"])
def test_rollback_drops_queued_uploads_and_deletes_abandoned_copies_but_not_the_new_timeline(
        s3_env, tmp_path, monkeypatch, in_flight):
    """A rollback to 4 abandons 6 (mirrored), 8 (upload in flight) and 10 (queued); then step 8 is saved
    again on the new timeline (while the old upload is still in flight, or after it failed on its
    vanished files). The mirror ends with 2, 4 and the new 8 only: 6 and the old 8 are deleted (or the
    old 8's upload stops quietly), 10 is never uploaded, and the deletion spares the new 8."""
    import threading

    import torch

    from trainguard.backup import background
    from trainguard.backup.restore import restore_for_resume

    started, release = threading.Event(), threading.Event()
    upload = background.mirror_checkpoint

    def gated(path, mirror, **kwargs):
        first_eight = Path(path).name == "global_step_8" and not started.is_set()
        if first_eight and in_flight == "loses its files":
            started.set()
            assert release.wait(120)  # the rollback deletes its local files meanwhile
        result = upload(path, mirror, **kwargs)
        if first_eight and in_flight == "finishes":
            started.set()
            assert release.wait(120)  # complete in the mirror when the rollback happens
        return result

    monkeypatch.setattr(background, "mirror_checkpoint", gated)
    run, target = tmp_path / "run", url(s3_env, f"rollback-{in_flight.replace(' ', '-')}")
    manager, model = _tiny_manager(run, target)
    try:
        assert manager.resume() == 0
        for step in (2, 4, 6, 8, 10):
            with torch.no_grad():
                model.weight.add_(1.0)
            manager.save_durable(step)
            if step == 8:
                assert started.wait(120)  # 2, 4 and 6 are mirrored, 8 is in flight, 10 will queue behind it
        assert manager.roll_back(before_step=5) == 4
        assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_2", "global_step_4"]
        if in_flight == "loses its files":  # let it fail on the missing files before step 8 exists again
            release.set()
            deadline = time.monotonic() + 120
            while manager.mirror.pending_steps() and time.monotonic() < deadline:
                time.sleep(0.05)
        with torch.no_grad():
            model.weight.add_(100.0)  # the new timeline's step 8: other bytes
        manager.save_durable(8)
    finally:
        release.set()
        manager.close()

    mirror = open_mirror(target)
    in_mirror = list_mirrored(mirror)
    assert sorted(in_mirror) == [2, 4, 8]
    assert in_mirror[8].files == read_manifest(run / "checkpoints" / "global_step_8").files  # the new timeline's
    assert not mirror.fs.find(mirror.path("global_step_6")) and not mirror.fs.find(mirror.path("global_step_10"))
    uploaded = [e["step"] for e in events(run, "checkpoint_mirrored") if not e["already_complete"]]
    assert uploaded == ([2, 4, 6, 8, 8] if in_flight == "finishes" else [2, 4, 6, 8])
    removed = [(e["step"], e["reason"]) for e in events(run, "checkpoint_deleted") if e["tier"] == "mirror"]
    assert removed == [(step, "abandoned by a rollback") for step in ([8, 6] if in_flight == "finishes" else [6])]
    assert not events(run, "mirror_failed")
    # --resume URL in a fresh run directory gets the new timeline's step 8
    fresh = tmp_path / "fresh" / "checkpoints"
    assert restore_for_resume(target, fresh, None) == "auto"
    assert sorted(p.name for p in fresh.glob("global_step_*")) == ["global_step_8"]
    assert read_manifest(fresh / "global_step_8").files == in_mirror[8].files


def test_resume_from_the_mirror_after_a_rollback_continues_the_new_timeline(s3, cli, committed_run, tmp_path):
    """Checkpoints 4 and 8 are mirrored; a run resumed from 4 spikes at 6, rolls back to 4 (abandoning
    8) and stops at 7. The mirror then holds 4 and 7, and ``--resume URL`` in a fresh run directory
    continues from the new timeline's 7, with the rollback's skipped window, not from the abandoned 8."""
    run, target = tmp_path / "run", url(s3, "rollback-e2e")
    shutil.copytree(committed_run, run)
    assert cli("ckpt", "backup", str(run), target)[0] == 0
    assert sorted(list_mirrored(open_mirror(target, s3.endpoint))) == [4, 8]
    proc = trainguard("train", "--nproc", "2", "--steps", "8", "--run-dir", str(run), *TINY, "--save-interval", "4",
                      "--resume", str(run / "checkpoints" / "global_step_4"), *ROLLBACK,
                      "--set", "train.exit_at_step=7", "--set", f"checkpoint.mirror.url={target}",
                      env=cli_env(s3, TRAINGUARD_FAULTS="spike:step=6"), timeout=600)
    ok(proc)
    assert [e["to_step"] for e in events(run, "rollback")] == [4]
    removed = [e for e in events(run, "checkpoint_deleted") if e["tier"] == "mirror"]
    assert [(e["step"], e["reason"]) for e in removed] == [(8, "abandoned by a rollback")]
    assert "mirror: deleted global_step_8 from " in proc.stdout + proc.stderr
    assert sorted(list_mirrored(open_mirror(target, s3.endpoint))) == [4, 7]

    fresh = tmp_path / "fresh"
    ok(train_s3(s3, fresh, 2, 8, "--save-interval", "4", "--resume", target))
    started = events(fresh, "run_started")[-1]
    assert started["step"] == 7 and started["resumed_from"].endswith("global_step_7")
    assert sampler_state(fresh / "checkpoints" / "global_step_8")["skipped"] == [[16, 28]]


def sampler_state(ckpt_dir: Path, rank: int = 0) -> dict:
    from trainguard.fs.layout import extra_state_name
    from trainguard.checkpoint.safe_load import safe_torch_load

    return safe_torch_load(ckpt_dir / extra_state_name(2, rank))["stateful"]["sampler"]
