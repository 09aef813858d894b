"""The reference's YAML keys (MindSpore data skip and health monitor) mapped onto trainguard's own.

A config written for the reference loads unchanged: its keys are rewritten into trainguard's sections
before validation. Giving a key both ways with different values is an error, never a silent pick.
"""

from __future__ import annotations

from typing import Any

from trainguard.errors import ConfigError

# reference key path -> trainguard key path
_SIMPLE = {
    ("use_skip_data_by_global_norm",): ("guards", "skip", "enabled"),
    ("use_checkpoint_health_monitor",): ("guards", "health", "enabled"),
    ("monitor_config", "monitor_on"): ("guards", "monitor"),
    ("monitor_config", "check_for_global_norm"): ("guards", "check_for_global_norm"),
    ("monitor_config", "global_norm_spike_threshold"): ("guards", "skip", "threshold"),
    ("monitor_config", "global_norm_spike_count_threshold"): ("guards", "skip", "count_threshold"),
    ("runner_wrapper", "local_norm"): ("guards", "local_norm"),
    ("parallel_config", "data_parallel"): ("parallel", "dp_shard"),
    ("parallel_config", "pipeline_stage"): ("parallel", "pp"),
    ("parallel_config", "micro_batch_num"): ("train", "micro_batches"),
    ("kill_switch_path",): ("lifecycle", "kill_switch_path"),  # reference 002's --kill-switch-path
    ("exit_duration_in_mins",): ("lifecycle", "exit_duration_in_mins"),  # and --exit-duration-in-mins
}
_CHECKPOINT_MONITOR = {
    "save_checkpoint_steps": ("checkpoint", "save_interval"),
    "embedding_local_norm_threshold": ("guards", "health", "embedding_threshold"),
}
_SECTIONS = {path[0] for path in _SIMPLE if len(path) > 1}


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any, alias: str, source: str) -> None:
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: config key {'.'.join(path[:-1])!r} must be a mapping")
    key = path[-1]
    if key in node and node[key] != value:
        raise ConfigError(
            f"{source}: {alias}={value!r} conflicts with {'.'.join(path)}={node[key]!r}; give one of them"
        )
    node[key] = value


def translate_reference_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Returns a copy of ``raw`` with every reference key moved to its trainguard key."""
    out = {k: v for k, v in raw.items() if k not in _SECTIONS and (k,) not in _SIMPLE and k != "callbacks"}
    for section in _SECTIONS:
        if section in raw and not isinstance(raw[section], dict):
            raise ConfigError(f"{source}: config key {section!r} must be a mapping")
        for key in raw.get(section) or {}:
            if (section, key) not in _SIMPLE:
                raise ConfigError(f"{source}: unknown config key {section + '.' + key!r}")
    for ref_path, our_path in _SIMPLE.items():
        node: Any = raw
        for part in ref_path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            _set(out, our_path, node, ".".join(ref_path), source)
    callbacks = raw.get("callbacks")
    if callbacks is not None:
        if not isinstance(callbacks, list):
            raise ConfigError(f"{source}: config key 'callbacks' must be a list")
        for i, callback in enumerate(callbacks):
            if not isinstance(callback, dict) or "type" not in callback:
                raise ConfigError(f"{source}: callbacks[{i}] must be a mapping with a 'type'")
            if callback["type"] != "CheckpointMonitor":
                raise ConfigError(
                    f"{source}: callbacks[{i}].type {callback['type']!r} is not supported (only CheckpointMonitor)"
                )
            for key, value in callback.items():
                if key == "type":
                    continue
                if key not in _CHECKPOINT_MONITOR:
                    raise ConfigError(f"{source}: unknown config key 'callbacks[{i}].{key}'")
                _set(out, _CHECKPOINT_MONITOR[key], value, f"callbacks[{i}].{key}", source)
    return out
