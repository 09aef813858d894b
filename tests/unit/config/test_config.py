"""Configuration: the reference's YAML loads unchanged; bad values are one clear error."""

from __future__ import annotations

import pytest

from trainguard.config import load_config
from trainguard.errors import ConfigError

REFERENCE_YAML = """\
use_skip_data_by_global_norm: True
monitor_config: {monitor_on: True, check_for_global_norm: False, global_norm_spike_threshold: 3.0, global_norm_spike_count_threshold: 10}
use_checkpoint_health_monitor: True
runner_wrapper: {local_norm: True}
callbacks: [{type: CheckpointMonitor, save_checkpoint_steps: 1, embedding_local_norm_threshold: 270.0}]
parallel_config: {data_parallel: 4, pipeline_stage: 2, micro_batch_num: 2}
"""


def _load(tmp_path, text: str, *overrides: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_reference_yaml_loads_unchanged(tmp_path):
    cfg = _load(tmp_path, REFERENCE_YAML)
    assert cfg.guards.skip.enabled and cfg.guards.skip.threshold == 3.0 and cfg.guards.skip.count_threshold == 10
    assert cfg.guards.health.enabled and cfg.guards.health.embedding_threshold == 270.0
    assert cfg.guards.monitor and cfg.guards.local_norm and not cfg.guards.check_for_global_norm
    assert cfg.checkpoint.save_interval == 1
    assert (cfg.parallel.dp_shard, cfg.parallel.pp, cfg.train.micro_batches) == (4, 2, 2)


def test_trainguard_keys_and_aliases_agree_or_conflict(tmp_path):
    cfg = _load(tmp_path, "use_skip_data_by_global_norm: True\nguards: {skip: {enabled: true, threshold: 5.0}}\n")
    assert cfg.guards.skip.enabled and cfg.guards.skip.threshold == 5.0
    with pytest.raises(ConfigError, match="conflicts"):
        _load(tmp_path, "monitor_config: {global_norm_spike_threshold: 3.0}\nguards: {skip: {threshold: 4.0}}\n")


@pytest.mark.parametrize(
    "text, message",
    [
        ("use_skip_data_by_global_norm: True\nmonitor_config: {check_for_global_norm: True}\n", "mutually exclusive"),
        ("monitor_config: {global_norm_spike_threshold: 0}\n", "global_norm_spike_threshold"),
        ("monitor_config: {global_norm_spike_threshold: -1.5}\n", "global_norm_spike_threshold"),
        ("monitor_config: {global_norm_spike_count_threshold: 2.5}\n", "count_threshold"),
        ("monitor_config: {global_norm_spike_count_threshold: 0}\n", "global_norm_spike_count_threshold"),
        ("parallel_config: {pipeline_stage: 4, micro_batch_num: 2}\n", "micro_batch_num"),
        ("callbacks: [{type: CheckpointMonitor, embedding_local_norm_threshold: 0}]\n", "embedding_local_norm_threshold"),
        ("callbacks: [{type: SummaryMonitor}]\n", "SummaryMonitor"),
        ("monitor_config: {spike: 1}\n", "monitor_config.spike"),
    ],
)
def test_bad_reference_values_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as exc:
        _load(tmp_path, text)
    assert "\n" not in str(exc.value) and "run.yaml" in str(exc.value)


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["optim.lr=1e-3", "checkpoint.keep_every=100", "guards.skip.mode=adaptive"])
    assert cfg.optim.lr == 1e-3 and cfg.checkpoint.keep_every == 100 and cfg.guards.skip.mode == "adaptive"


def test_non_finite_floats_are_refused():
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=nan"])
    with pytest.raises(ConfigError, match="guards.skip.threshold"):
        load_config(None, ["guards.skip.threshold=.inf"])


def test_an_error_names_the_set_item_of_the_key_not_the_file(tmp_path):
    """Issue 38 item 7: a key typed after --set is the --set item's fault, never the file's."""
    path = tmp_path / "guard.yaml"
    path.write_text("guards:\n  skip: {enabled: true, threshold: 50.0}\n")
    with pytest.raises(ConfigError) as unknown:
        load_config(path, ["guards.skip.count_threshold=3", "guards.skip.treshold=3"])
    assert str(unknown.value) == "--set 'guards.skip.treshold=3': unknown config key 'guards.skip.treshold'"
    with pytest.raises(ConfigError) as wrong_type:
        load_config(path, ["guards.skip={threshold: many}"])
    assert str(wrong_type.value).startswith("--set 'guards.skip={threshold: many}': config key 'guards.skip.threshold'")
    with pytest.raises(ConfigError) as out_of_range:  # the file alone is valid: the override is at fault
        load_config(path, ["guards.skip.threshold=-1"])
    assert str(out_of_range.value).startswith("--set 'guards.skip.threshold=-1': config key 'guards.skip.threshold")
    path.write_text("guards:\n  skip: {enabled: true, treshold: 50.0}\n")
    with pytest.raises(ConfigError) as in_file:
        load_config(path, ["guards.skip.threshold=3"])
    assert str(in_file.value) == f"{path}: unknown config key 'guards.skip.treshold'"
