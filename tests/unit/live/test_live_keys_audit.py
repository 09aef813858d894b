"""The audit of issue 35's "no key accepted and then ignored" in live mode: every key of the run
configuration is either honoured in live mode or refused there with one line naming it.

Every key is walked (a key added to the schema fails ``test_every_key_is_classified`` until it is put on
one side). Honoured keys are shown to reach the live engine: the launcher's (``LiveRun.from_config``),
the rank's (``Guard``'s ``LiveRank``: its seed, durable tier and rules: clipping, data skip, the skip
streak, SDC detection, checkpoint health, the embedding monitor, ``train.exit_at_step``, the kill switch
and the time limit), or the reference trainer's (``trainer/live.py`` builds its model and
optimizer from the whole ``model`` and ``optim`` sections with the closure mode's builders, and reads
each ``data`` key); a changed value must change what they build. Refused keys, each set alone to a value
other than its default, must stop ``trainguard train``'s live path (``cli.train_live.live_run``) with one line naming the key:
only ``model.init_from``, ``parallel.pp`` and ``parallel.tp`` are left (every key of ``checkpoint``, ``guards``
and ``lifecycle`` is honoured).
``optim.grad_clip`` and ``train.seed`` are honoured end to end in ``tests/integration/test_live_config_keys.py``."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
from typing import Any

import pytest
import torch

import trainguard.trainer.live
from trainguard.cli.train_live import live_run
from trainguard.config.schema import RunConfig
from trainguard.errors import ConfigError
from trainguard.live.launcher import LiveRun
from trainguard.step.live import LAUNCHER_OVERRIDES_ENV, live_rank, with_launcher_overrides
from trainguard.trainer.model import build_model_config
from trainguard.trainer.optim import build_optimizer

# honoured: each key with a valid value other than its default
LAUNCHER = {
    "parallel.dp_replicate": 4, "parallel.dp_shard": 1, "train.steps": 31, "train.micro_batches": 16,
    "fault_tolerance.live": False, "fault_tolerance.spares": 1, "fault_tolerance.hang_s": 11.0,
    "fault_tolerance.startup_s": 601.0, "fault_tolerance.max_start_failures": 4, "fault_tolerance.collective_timeout_s": 31.0, "fault_tolerance.doctor_spares": False,
    "fault_tolerance.stall_s": 6.0, "fault_tolerance.stall_steps": 11.0, "faults": "kill:rank=1,step=2",
    # the ranks' --fsdp: the reference trainer's then shard with FSDP2 (tests/integration/test_live_trainer_fsdp.py)
    "fault_tolerance.fsdp": True,
}
RANK = {"train.seed": 43, "optim.grad_clip": 0.5,
        # the durable tier's, which live mode runs (``live.durable``; tests/integration/test_live_durable.py)
        "checkpoint.save_interval": 7, "checkpoint.keep_last": 4, "checkpoint.keep_every": 20,
        "checkpoint.resume": "disable", "checkpoint.async_save": False, "checkpoint.writer": "thread",
        # the local and memory tiers (``live.local_tier``; tests/integration/test_live_durable.py)
        "checkpoint.local_interval": 2, "checkpoint.local_dir": "/tmp/local", "checkpoint.local_keep_last": 3,
        "checkpoint.memory_interval": 1, "checkpoint.memory_dir": "/tmp/memory", "checkpoint.memory_keep_last": 3,
        "parallel.ranks_per_node": 1,
        # the mirror of durable checkpoints (``backup.attach``; tests/integration/test_live_durable.py)
        "checkpoint.mirror.url": "s3://bucket/run", "checkpoint.mirror.every": 2, "checkpoint.mirror.keep_every": 4,
        "checkpoint.mirror.bandwidth_mbps": 10.0, "checkpoint.mirror.endpoint_url": "http://127.0.0.1:1",
        "checkpoint.mirror.workers": 2,
        # the skip decisions and the stops (``live.step_judge``, ``LiveWorker.stop_here``;
        # tests/integration/test_live_guards.py)
        "guards.skip.enabled": True, "guards.skip.threshold": 5.0, "guards.skip.count_threshold": 3,
        "guards.skip.mode": "adaptive", "guards.skip.window": 64, "guards.skip.z_threshold": 5.0,
        "guards.skip.warmup": 10, "guards.skip.regime_steps": 4, "guards.skip.loss": True,
        "guards.skip.replay_steps": [2], "guards.max_consecutive_skips": 7, "train.exit_at_step": 2,
        "lifecycle.kill_switch_path": "/nonexistent/switch", "lifecycle.exit_duration_in_mins": 60.0,
        "lifecycle.exit_margin_seconds": 30.0,
        # the heartbeat files (``LiveRank.start``; tests/integration/test_live_guards.py)
        "lifecycle.heartbeats": False,
        # SDC detection with its rerun (``live.sdc``; tests/integration/test_live_sdc.py)
        "guards.sdc.enabled_level": 2, "guards.sdc.rule": "v3", "guards.sdc.upper": [100000, 1000],
        "guards.sdc.sigma": [50000, 1000], "guards.sdc.rerun": False, "guards.sdc.strikes": 2,
        "guards.sdc.strike_window_hours": 4.0, "guards.sdc.points": ["0"], "guards.sdc.ratio": 2.0,
        "guards.sdc.peak": 0.25, "guards.sdc.row_jump": 50.0, "guards.sdc.blocks": False,
        "guards.sdc.gradients": False, "guards.sdc.lm_head": False, "guards.sdc.loss_scale": 2.0,
        # replica fingerprints (``live.fingerprint``; tests/integration/test_live_sdc.py)
        "guards.fingerprint.interval": 7, "guards.fingerprint.at_rest": "every_step",
        # checkpoint health and the embedding monitor (``LiveWorker.health``; tests/integration/test_live_guards.py)
        "guards.health.enabled": True, "guards.health.embedding_threshold": 5.0, "guards.monitor": True,
        # the retry limit of a step whose computation raised (``live.step_failures``; test_live_durable.py)
        "fault_tolerance.max_step_failures": 5,
        # rollback mode (``live.data_positions``, ``checkpoint.spike_rollback``; tests/integration/test_live_rollback.py)
        "guards.check_for_global_norm": True, "guards.rollback.window_before": 7, "guards.rollback.window_after": 7,
        "guards.rollback.widen_factor": 3.0, "guards.rollback.max_rollbacks": 5, "guards.rollback.loss": True,
        # each rank's local norms and the quorum's step lines (``LiveWorker.step``; tests/integration/test_live_guards.py)
        "guards.local_norm": True, "train.log_interval": 3}
TRAINER_MODEL = {
    "model.preset": "llama-micro", "model.hidden_size": 96, "model.num_layers": 3, "model.num_heads": 4,
    "model.num_kv_heads": 1, "model.intermediate_size": 100, "model.tie_word_embeddings": False,
    "model.attn_implementation": "eager",
}
TRAINER_OPTIM = {
    "optim.lr": 0.002, "optim.min_lr_ratio": 0.2, "optim.warmup_steps": 3, "optim.decay_steps": 50,
    "optim.weight_decay": 0.2, "optim.beta1": 0.8, "optim.beta2": 0.9, "optim.eps": 1e-6,
}
TRAINER_DATA = ("data.seq_len", "data.micro_batch_size", "data.seed")
HONOURED = {*LAUNCHER, *RANK, *TRAINER_MODEL, *TRAINER_OPTIM, *TRAINER_DATA}


def all_keys(config: Any = None, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the run configuration, dotted, with its default."""
    config = RunConfig() if config is None else config
    keys = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            keys.update(all_keys(value, f"{prefix}{field.name}."))
        else:
            keys[f"{prefix}{field.name}"] = value
    return keys


REFUSED = sorted(set(all_keys()) - HONOURED)
REFUSED_VALUES = {"parallel.tp": 2, "parallel.pp": 2}  # where ``other_than`` would give an allowed one (1)


def with_key(config: RunConfig, key: str, value: Any) -> RunConfig:
    changed = copy.deepcopy(config)
    *sections, name = key.split(".")
    target = changed
    for section in sections:
        target = getattr(target, section)
    setattr(target, name, value)
    return changed


def other_than(default: Any) -> Any:
    """A value of the key's kind that is not its default (only compared with it, never used)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, (list, tuple)):
        return type(default)([*default, default[0] if default else 1])
    return 1 if default is None else None


def live_config() -> RunConfig:
    config = RunConfig()
    config.fault_tolerance.live = True
    config.parallel.dp_replicate = 2
    config.train.micro_batches = 8
    return config


def test_every_key_is_classified():
    keys = set(all_keys())
    assert HONOURED <= keys, sorted(HONOURED - keys)
    assert len(keys) == len(HONOURED) + len(REFUSED)
    assert {"optim.grad_clip", "train.seed", "train.log_interval", "guards.local_norm"} <= HONOURED


def _trainer_args() -> argparse.Namespace:
    return argparse.Namespace(nproc=4, supervisor_defaults={}, config=None, overrides=[], steps=None,
                              save_interval=None, resume=None)


@pytest.mark.parametrize("key", REFUSED)
def test_a_key_live_mode_does_not_honour_is_refused_with_one_line_naming_it(key):
    config = with_key(live_config(), key, REFUSED_VALUES.get(key, other_than(all_keys()[key])))
    with pytest.raises(ConfigError) as refused:
        live_run(_trainer_args(), config, "run.yaml")
    message = str(refused.value)
    assert f"'{key}'" in message and "\n" not in message, message


@pytest.mark.parametrize("key", sorted(LAUNCHER))
def test_a_launcher_key_changes_the_live_run(key):
    config = live_config()
    config.parallel.dp_shard = 2
    changed = with_key(config, key, LAUNCHER[key])
    if key == "fault_tolerance.live":  # the switch itself: off, there is no live run
        with pytest.raises(ConfigError, match="fault_tolerance.live"):
            LiveRun.from_config(changed)
        return
    assert LiveRun.from_config(changed) != LiveRun.from_config(config)


@pytest.mark.parametrize("key", sorted(RANK))
def test_a_rank_key_reaches_the_live_rank(key, tmp_path):
    argv = ["--store", "127.0.0.1:1", "--rank", "0", "--world", "2", "--steps", "3", "--run-dir", str(tmp_path),
            "--micro-batches", "4"]
    model = torch.nn.Linear(2, 1)

    def seen(config: RunConfig) -> tuple:
        rank = live_rank(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), None, config, argv, [],
                         embedding=model.weight)
        return rank.seed, rank.rules, rank.checkpoint

    config = live_config()
    # rollback mode's keys are read with it on
    config.guards.check_for_global_norm = key.startswith("guards.rollback.")
    assert seen(with_key(config, key, RANK[key])) != seen(config)


@pytest.mark.parametrize("key", sorted(TRAINER_MODEL))
def test_a_model_key_changes_the_trainers_model(key):
    config = live_config()
    changed = with_key(config, key, TRAINER_MODEL[key])
    def built(model):  # the attention implementation is not in ``to_dict``
        built = build_model_config(model, config.data.seq_len)
        return built.to_dict(), built._attn_implementation

    assert built(changed.model) != built(config.model)


@pytest.mark.parametrize("key", sorted(TRAINER_OPTIM))
def test_an_optim_key_changes_the_trainers_optimizer_or_schedule(key):
    def built(config: RunConfig) -> tuple:
        optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 1), config.optim, 100)
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        return hyper, [scheduler.lr_lambdas[0](step) for step in range(100)]

    config = live_config()
    assert built(with_key(config, key, TRAINER_OPTIM[key])) != built(config)


def test_the_trainers_live_rank_reads_its_sections_and_every_data_key():
    source = inspect.getsource(trainguard.trainer.live)
    assert "build_model_config(config.model" in source and "build_optimizer(model, config.optim" in source
    for key in TRAINER_DATA:
        assert f"config.{key}" in source, key


def test_the_launchers_set_items_are_applied_over_the_ranks_configuration():
    config = live_config()
    environ = {LAUNCHER_OVERRIDES_ENV: json.dumps(["train.seed=7", "optim.grad_clip=0.25"])}
    merged = with_launcher_overrides(config, environ)
    assert (merged.train.seed, merged.optim.grad_clip) == (7, 0.25)
    assert (config.train.seed, config.optim.grad_clip) == (42, 1.0)  # the script's own object is left alone
    assert with_launcher_overrides(config, {}) is config


def test_launcher_set_items_are_checked_on_the_ranks_configuration_not_alone():
    """``parallel.pp=2`` alone, on the defaults (``train.micro_batches: 1``), fails the pipeline's check; on
    this configuration (8 micro-batches) it is valid: it was refused before (each item was loaded alone)."""
    merged = with_launcher_overrides(live_config(), {LAUNCHER_OVERRIDES_ENV: json.dumps(["parallel.pp=2"])})
    assert merged.parallel.pp == 2 and merged.train.micro_batches == 8


@pytest.mark.parametrize("text, named", [("not json", LAUNCHER_OVERRIDES_ENV), ('["train.nope=1"]', "train.nope"),
                                         ('["optim.grad_clip=-1"]', "optim.grad_clip")])
def test_a_bad_launcher_set_item_is_one_error_naming_it(text, named):
    with pytest.raises(ConfigError) as refused:
        with_launcher_overrides(live_config(), {LAUNCHER_OVERRIDES_ENV: text})
    assert named in str(refused.value) and "\n" not in str(refused.value)
