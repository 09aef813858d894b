"""``Guard``'s live mode (``fault_tolerance.live``): one ``Guard``, one loop, live mode refusing the earlier
zero-argument closure with one clear error and what else it would not do rather than ignoring it, and
taking ``hf_config``; the closure mode refusing the live-only calls; a ``LambdaLR`` setting each step's LR
from the step alone;
``trainguard train`` in live mode refusing, before making anything, what the live path does not do.

A rank in live mode is built here from the launcher's flags without a launcher: nothing connects to
the store before the first ``resume``, ``should_stop`` or ``step(loss_of)``. The full live runs are tests/integration/test_live_*.py."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
import torch

import trainguard
from trainguard.cli import main
from trainguard.config import FaultToleranceConfig, RunConfig, load_config
from trainguard.errors import ConfigError
from trainguard.events.rank_logging import LOGGER_NAME
from helpers.counter import Counter

LIVE = RunConfig(fault_tolerance=FaultToleranceConfig(live=True))


def launcher_flags(run_dir: Path) -> list[str]:
    return ["--store", "127.0.0.1:1", "--rank", "1", "--world", "4", "--steps", "12", "--run-dir", str(run_dir),
            "--micro-batches", "8"]


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
    return model(torch.full((1, 3), float(step + micro_batch))).sum()


@pytest.fixture
def live_guard(tmp_path):
    model, optimizer = model_and_optimizer()
    return trainguard.Guard(tmp_path, model, optimizer, config=LIVE, live_argv=launcher_flags(tmp_path))


@pytest.fixture
def closure_guard(tmp_path, monkeypatch):
    """A ``Guard`` with live recovery off; its logging and signal handlers are the test's, not pytest's."""
    monkeypatch.setattr(logging.getLogger(LOGGER_NAME), "handlers", [logging.NullHandler()])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    model, optimizer = model_and_optimizer()
    guard = trainguard.Guard(tmp_path, model, optimizer)
    yield guard
    guard.close()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_the_key_is_off_by_default_and_read_from_yaml_and_set(tmp_path):
    assert RunConfig().fault_tolerance == FaultToleranceConfig(live=False, spares=0, hang_s=10.0,
                                                               collective_timeout_s=30.0, stall_s=5.0, stall_steps=10.0,
                                                               startup_s=600.0)
    path = tmp_path / "run.yaml"
    path.write_text("fault_tolerance: {live: true, spares: 1, hang_s: 4, stall_s: 2, startup_s: 120}\n")
    config = load_config(path, ["fault_tolerance.collective_timeout_s=5", "fault_tolerance.stall_steps=4"])
    assert config.fault_tolerance == FaultToleranceConfig(live=True, spares=1, hang_s=4.0, collective_timeout_s=5.0,
                                                          stall_s=2.0, stall_steps=4.0, startup_s=120.0)


@pytest.mark.parametrize("item, message", [
    ("fault_tolerance.live=maybe", "config key 'fault_tolerance.live' must be bool, got 'maybe'"),
    ("fault_tolerance.spares=-1", "config key 'fault_tolerance.spares' must be ≥ 0, got -1"),
    ("fault_tolerance.hang_s=0", "config key 'fault_tolerance.hang_s' must be > 0, got 0.0"),
    ("fault_tolerance.collective_timeout_s=-3", "config key 'fault_tolerance.collective_timeout_s' must be > 0"),
    ("fault_tolerance.stall_s=0", "config key 'fault_tolerance.stall_s' must be > 0"),
    ("fault_tolerance.startup_s=0", "config key 'fault_tolerance.startup_s' must be > 0, got 0.0"),
    ("fault_tolerance.startup_s=soon", "config key 'fault_tolerance.startup_s' must be float, got 'soon'"),
    ("fault_tolerance.max_start_failures=0", "config key 'fault_tolerance.max_start_failures' must be > 0, got 0"),
    ("fault_tolerance.stall_steps=-1", "config key 'fault_tolerance.stall_steps' must be > 0"),
    ("fault_tolerance.lve=true", "unknown config key 'fault_tolerance.lve'"),
])
def test_a_bad_value_is_one_error_naming_the_key(item, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as error:
        load_config(None, [item])
    assert "\n" not in str(error.value)


def test_live_mode_takes_the_runs_shape_from_the_launcher_and_refuses_a_zero_argument_closure(live_guard, tmp_path):
    assert (live_guard.total_steps, live_guard.micro_batches) == (12, 8)
    with pytest.raises(ConfigError, match=r"Guard.step\(closure\) is refused with fault_tolerance.live: true: live "
                                          r"recovery needs the loss of each micro-batch.*guard.step\(loss_of\)"):
        live_guard.step(lambda: None)
    assert not (tmp_path / "events.jsonl").exists()  # nothing of the closure mode was built


def test_closure_mode_refuses_the_live_only_calls_at_the_call_not_at_the_first_iteration(closure_guard):
    for call in (lambda: closure_guard.steps(loss_of), lambda: closure_guard.total_steps):
        with pytest.raises(ConfigError, match=r"needs live recovery: set config key 'fault_tolerance.live' to true"):
            call()
    assert closure_guard.micro_batches == 1  # train.micro_batches: the global batch, in both modes
    assert closure_guard.resume() == 0  # the closure mode itself works


def test_launcher_flags_without_live_mode_are_refused(tmp_path):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError, match=r"Guard.__init__\(live_argv=...\) needs live recovery"):
        trainguard.Guard(tmp_path, model, optimizer, live_argv=launcher_flags(tmp_path))


@pytest.mark.parametrize("arguments, named", [
    ({"mesh": object()}, "mesh=..."),
    ({"pipeline_stages": 2}, "pipeline_stages=..."),
])
def test_live_mode_refuses_the_arguments_it_cannot_honour(tmp_path, arguments, named):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError, match=rf"Guard\({named}\): not supported with fault_tolerance.live: true"):
        trainguard.Guard(tmp_path, model, optimizer, config=LIVE, live_argv=launcher_flags(tmp_path), **arguments)


def test_live_mode_takes_the_last_keys_it_refused_and_the_tokens_per_step(tmp_path):
    """Every key of the configuration runs in live mode now (tests/unit/live/test_live_keys_audit.py walks them);
    these were the last refused: tests/integration/test_live_guards.py and test_live_trainer.py run them."""
    model, optimizer = model_and_optimizer()
    config = load_config(None, ["fault_tolerance.live=true", "guards.local_norm=true", "train.log_interval=5"])
    guard = trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=launcher_flags(tmp_path),
                             tokens_per_step=64)
    rules = guard._live.rules
    assert (rules.local_norm, rules.log_interval, rules.tokens_per_step) == (True, 5, 64)


def test_live_mode_takes_the_durable_tiers_keys(tmp_path):  # tests/integration/test_live_durable.py runs them
    model, optimizer = model_and_optimizer()
    config = load_config(None, ["fault_tolerance.live=true", "checkpoint.save_interval=5", "checkpoint.keep_last=2",
                                "checkpoint.keep_every=10", "checkpoint.resume=disable", "checkpoint.async_save=false",
                                "checkpoint.writer=thread", f"checkpoint.local_dir={tmp_path}/local",
                                "checkpoint.local_interval=2", "checkpoint.local_keep_last=3",
                                f"checkpoint.memory_dir={tmp_path}/memory", "checkpoint.memory_interval=1",
                                "checkpoint.memory_keep_last=1", "parallel.ranks_per_node=1",
                                "checkpoint.mirror.url=file:///nonexistent/mirror", "checkpoint.mirror.every=2"])
    guard = trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=launcher_flags(tmp_path))
    assert guard.micro_batches == 8  # taken, not refused: the multi-process tests show them at work


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=12),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (step + 3))])
def test_live_mode_takes_any_scheduler_and_stateful_objects(tmp_path, make):
    """tests/unit/live/test_live_state.py: what they become; tests/integration/test_live_guards.py: at work."""
    model, optimizer = model_and_optimizer()
    guard = trainguard.Guard(tmp_path, model, optimizer, make(optimizer), stateful={"data": Counter()}, config=LIVE,
                             live_argv=launcher_flags(tmp_path))
    assert guard.micro_batches == 8


@pytest.mark.parametrize("name", ["scheduler", "live_guards"])
def test_live_mode_refuses_a_stateful_name_of_its_own_in_one_line(tmp_path, name):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError, match=rf"^Guard\(stateful=...\): the names \['{name}'\] are the live engine's own"):
        trainguard.Guard(tmp_path, model, optimizer, stateful={name: Counter()}, config=LIVE,
                         live_argv=launcher_flags(tmp_path))


def test_live_mode_outside_the_live_launcher_is_one_error_saying_so(tmp_path):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError, match=r"^fault_tolerance.live: true, but this process was not started by the "
                                          r"live launcher \(no --store among its arguments\)"):
        trainguard.Guard(tmp_path, model, optimizer, config=LIVE, live_argv=["--run-dir", str(tmp_path), "--lr", "1"])


def test_live_mode_refuses_a_run_directory_that_is_not_the_launchers(tmp_path):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError, match=r"the live launcher started this rank with --run-dir '.*launcher'"):
        trainguard.Guard(tmp_path / "mine", model, optimizer, config=LIVE,
                         live_argv=launcher_flags(tmp_path / "launcher"))


def test_live_mode_takes_hf_config_for_its_durable_checkpoints_and_the_alias_is_gone(tmp_path):
    from transformers import GPT2Config

    model, optimizer = model_and_optimizer()
    guard = trainguard.Guard(tmp_path, model, optimizer, config=LIVE, live_argv=launcher_flags(tmp_path),
                             hf_config=GPT2Config(n_layer=1), mesh=None)
    assert guard._live.static_files is not None  # handed to the durable tier (test_live_user_loop merges it)
    assert not hasattr(trainguard, "LiveGuard")


@pytest.mark.parametrize("flags, message", [
    (["--max-restarts", "1"], "--max-restarts: a supervisor option; with fault_tolerance.live: true the live launcher"),
    (["--set", "parallel.dp_replicate="], "--set: config key 'parallel.dp_replicate' must be ≥ 2 for a live run"),
    # --launcher hosts and slurm are taken (where the ranks run), and checked before anything starts
    (["--launcher", "hosts", "--hosts", "n1=127.0.0.1", "--node-command", "env"],
     "--hosts 'n1=127.0.0.1': 1 host(s) for 2 replica groups: one host per replica group"),
    (["--launcher", "slurm"], "--launcher slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm allocation)"),
])
def test_the_reference_trainer_in_live_mode_refuses_what_it_does_not_do_in_one_line(tmp_path, capsys, flags, message):
    code = main(["train", "--nproc", "4", "--run-dir", str(tmp_path / "run"), "--set", "fault_tolerance.live=true",
                 "--set", "parallel.dp_replicate=2", "--set", "train.micro_batches=4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("trainguard: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # refused before anything was made


LAUNCHER_FLAGS = ["--store", "127.0.0.1:1", "--world", "4", "--steps", "2", "--run-dir", "run", "--micro-batches", "8"]


def test_the_data_parallel_mesh_is_none_for_a_rank_of_whole_replicas():
    """The same script in both modes: under the live launcher (its --store flag) with replica groups of one
    rank the model stays whole (no default process group is made); under torchrun
    (test_user_loop_faults.py) it is FSDP2's mesh; with groups of several ranks the group's mesh
    (tests/integration/test_live_fsdp.py)."""
    import torch.distributed as dist

    assert trainguard.data_parallel_mesh(["--config", "run.yaml", *LAUNCHER_FLAGS, "--rank", "0"]) is None
    assert not dist.is_initialized()


def test_without_fault_tolerance_fsdp_a_sharded_group_gets_no_mesh():
    """With replica groups of 2 ranks but no --fsdp (``fault_tolerance.fsdp`` off), the model stays whole and
    live mode shards it by rows: no mesh, no default process group."""
    import torch.distributed as dist

    assert trainguard.data_parallel_mesh([*LAUNCHER_FLAGS, "--rank", "1", "--group-size", "2"]) is None
    assert not dist.is_initialized()


@pytest.mark.parametrize("items, key", [(["fault_tolerance.spares=1"], "fault_tolerance.spares"),
                                        (["parallel.dp_shard=1"], "fault_tolerance.fsdp")])
def test_fault_tolerance_fsdp_with_spares_or_whole_replicas_is_refused_naming_the_key(items, key):
    """Warm spares come in spare groups of dp_shard ranks (each makes its mesh with its spare group as it
    starts), and FSDP2 needs a group of several ranks: the launcher refuses a spare count that is no multiple
    of dp_shard, and dp_shard 1, before starting anything."""
    from trainguard.live.launcher import LiveRun

    layout = ["fault_tolerance.live=true", "fault_tolerance.fsdp=true", "parallel.dp_replicate=2",
              "parallel.dp_shard=2", "train.micro_batches=8"]
    assert LiveRun.from_config(load_config(None, layout)).fsdp
    assert LiveRun.from_config(load_config(None, [*layout, "fault_tolerance.spares=2"])).spares == 2
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        LiveRun.from_config(load_config(None, [*layout, *items]))


@pytest.mark.parametrize("item, key", [("guards.health.enabled=true", "guards.health.enabled"),
                                       ("guards.monitor=true", "guards.monitor")])
def test_live_health_or_monitor_on_a_model_without_an_embedding_is_one_error_naming_the_key(tmp_path, item, key):
    model, optimizer = model_and_optimizer()  # a Linear: no input embedding to find
    config = load_config(None, ["fault_tolerance.live=true", item])
    with pytest.raises(ConfigError, match=rf"^config key '{key}': the model has no input embedding"):
        trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=launcher_flags(tmp_path))
    assert trainguard.Guard(tmp_path, model, optimizer, config=config, embedding=model.weight,
                            live_argv=launcher_flags(tmp_path)).micro_batches == 8


def test_fault_tolerance_fsdp_with_a_model_not_sharded_by_fully_shard_is_refused_naming_the_key(tmp_path):
    """The key on and the script's model whole: refused, not trained by rows in silence."""
    model, optimizer = model_and_optimizer()
    config = RunConfig(fault_tolerance=FaultToleranceConfig(live=True, fsdp=True))
    with pytest.raises(ConfigError, match="config key 'fault_tolerance.fsdp'"):
        trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=launcher_flags(tmp_path))
