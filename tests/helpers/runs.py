"""Shared test helpers: launching the reference trainer as users do, and reading what a run left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from trainguard.fs.layout import extra_state_name, step_dir_name
from trainguard.checkpoint.manifest import build_manifest, write_manifest

from helpers.warm_command import warm_server

# A model and batch small enough for many multi-process runs on two CPU cores.
TINY = ["--set", "model.preset=llama-micro", "--set", "data.seq_len=32", "--set", "data.micro_batch_size=2"]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRAINGUARD_FAULTS", None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def trainguard(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``python -m trainguard ARGS`` and returns the finished process (stdout and stderr captured).
    A session of its own, so that a timeout kills the supervisor's agents and ranks too, not only it.
    Forked from a warm interpreter (``helpers/warm_command.py``): the same command without seconds of
    imports per call."""
    proc = warm_server().start(list(args), env or worker_env())
    return finish_session(proc, timeout, f"trainguard {' '.join(args[:1])}")


def start_train(run_dir: Path, nproc: int, steps: int, *extra: str, faults: str | None = None):
    """``trainguard train`` started and not waited for (``finish_session`` ends it): a fault-free reference
    trains while a test's faulted run mostly sleeps in its faults and timeouts."""
    env = worker_env(**({"TRAINGUARD_FAULTS": faults} if faults else {}))
    return warm_server().start(["train", "--nproc", str(nproc), "--steps", str(steps), "--run-dir", str(run_dir),
                                *TINY, *extra], env)


def train(run_dir: Path, nproc: int, steps: int, *extra: str, faults: str | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    return finish_session(start_train(run_dir, nproc, steps, *extra, faults=faults), timeout, "trainguard train")


def run_in(root: Path, name: str, run: Callable[[Path], object]) -> tuple[Path, object]:
    return root / name, run(root / name)


@contextmanager
def launch_together(root: Path, runs: dict[str, Callable[[Path], object]], concurrent: int = 2
                    ) -> Iterator[dict[str, Future]]:
    """Every run of ``runs`` (name: a function of its directory ``root/name``, which launches and waits)
    submitted at once, ``concurrent`` at a time; gives name: the future of (directory, what the function
    returned), which each test waits for, and waits for all at the end. A launch's torchrun start, rendezvous and
    teardown, a fault's stand-still and a supervisor's restart leave a core idle that another run's ranks
    use; more than two at a time would queue for the two cores."""
    with ThreadPoolExecutor(max_workers=concurrent) as pool:
        yield {name: pool.submit(run_in, root, name, run) for name, run in runs.items()}


def launched_fixture(directory: str, runs: dict[str, Callable[[Path], object]]):
    """A module fixture ``launched``: ``launch_together`` of ``runs`` in a new temporary directory named
    ``directory``, started when the module's first test asks for it."""
    @pytest.fixture(scope="module")
    def launched(tmp_path_factory) -> Iterator[dict[str, Future]]:
        with launch_together(tmp_path_factory.mktemp(directory), runs) as futures:
            yield futures
    return launched


def succeeded(launched: Future) -> Path:
    """The directory of a run of ``launch_together`` that exited 0 (else the test fails with its output's end)."""
    run_dir, proc = launched.result()
    assert proc.returncode == 0, proc.stdout[-4000:]
    return run_dir


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    from trainguard.events import read_events

    path = Path(run_dir) / "events.jsonl"
    return list(read_events(path, kind)) if path.exists() else []


def killed_then_resumed(run, run_dir: Path, faults: str, steps_in, total_steps: int
                        ) -> subprocess.CompletedProcess:
    """``run(run_dir, faults)`` killed by ``faults`` (``kill:...,step=K``) before step K's line, then
    ``run(run_dir, None)`` resumed from the newest committed checkpoint (async saves: 2 or 4, the kill may
    come before global_step_4 commits) through ``total_steps``; ``steps_in(output)``: the steps its lines
    name. Returns the resumed run."""
    killed_step = int(faults.rsplit("step=", 1)[1])
    killed = run(run_dir, faults)
    assert killed.returncode != 0 and killed_step not in steps_in(killed.stdout), killed.stdout[-3000:]
    resumed = run(run_dir, None)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    first, resumed_from = [e["step"] for e in events(run_dir, "run_started")]
    assert first == 0 and resumed_from in (2, 4)
    assert sorted(steps_in(resumed.stdout)) == list(range(resumed_from + 1, total_steps + 1))
    return resumed


def step_losses(run_dir: Path) -> dict[int, float]:
    """The loss logged for each step; a step redone after a crash keeps its last value."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


def flat_state(ckpt_dir: Path) -> dict[str, object]:
    from trainguard.checkpoint.durable import read_full_state_dict

    def flatten(d: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out.update(flatten(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    return flatten(read_full_state_dict(ckpt_dir))


def assert_same_tensors(a_dir: Path, b_dir: Path) -> int:
    a, b = flat_state(a_dir), flat_state(b_dir)
    assert a.keys() == b.keys()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    different = [k for k in tensors if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"
    return len(tensors)


def torchrun(script: Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``script`` under ``torch.distributed.run --standalone``; stdout and stderr together in
    ``stdout``. A session of its own, so that a timeout kills the workers too, not only torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or worker_env(), start_new_session=True)
    return finish_session(proc, timeout, script.name)


def finish_session(proc: subprocess.Popen, timeout: float, what: str) -> subprocess.CompletedProcess:
    """Waits for ``proc`` (started with ``start_new_session=True``, stdout piped, stderr piped or with
    stdout); on a timeout kills its whole session and fails with the output's end."""
    try:
        output, errors = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, errors = proc.communicate()
        raise AssertionError(f"{what} did not finish in {timeout}s:\n{output[-4000:]}\n{(errors or '')[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, errors or "")


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def make_checkpoint(root: Path, step: int, *, world_size: int = 2, health: dict | None = None,
                    trainer_state: dict | None = None) -> Path:
    """A committed checkpoint with small files in the real layout and a real manifest."""
    ckpt = root / step_dir_name(step)
    (ckpt / "huggingface").mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"metadata-%d" % step)
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(3000))
    (ckpt / "__1_0.distcp").write_bytes(os.urandom(2000))
    for rank in range(world_size):
        (ckpt / extra_state_name(world_size, rank)).write_bytes(b"extra-%d" % rank)
    (ckpt / "huggingface" / "config.json").write_text('{"model_type": "llama"}')
    manifest = build_manifest(
        ckpt,
        step=step,
        world_size=world_size,
        mesh_shape=[world_size],
        mesh_dim_names=["dp_shard"],
        trainer_state=trainer_state or {"step": step, "consumed_samples": step * 8},
        health=health,
    )
    write_manifest(ckpt, manifest)
    return ckpt


def read_json(path: Path):
    return json.loads(Path(path).read_text())


OUTSIDE_TEXT = "a file outside the checkpoint\n"


def outside_file() -> Path:
    """A file outside any checkpoint for symlinks to point at: never a system file (the tests run as
    root, and a bug that wrote through such a link must damage nothing but this)."""
    directory = Path(tempfile.mkdtemp(prefix="trainguard-outside-"))
    target = directory / "outside.txt"
    target.write_text(OUTSIDE_TEXT)
    return target
