"""Loads a run configuration from YAML plus ``--set section.key=value`` overrides, strictly.

Unknown keys, wrong types and out-of-range values are ``ConfigError``s naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainguard.backup.config import validate_mirror_config
from trainguard.checkpoint.config import WRITERS
from trainguard.config.aliases import translate_reference_keys
from trainguard.config.presets import PRESETS
from trainguard.config.schema import RunConfig
from trainguard.fs.bounded import read_regular_text
from trainguard.guards.sdc.config import sdc_config_from_env
from trainguard.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_ALIASES = 64
MAX_YAML_NODES = 100_000
"""Nodes of the document with every alias expanded: what building it and walking it costs."""
MAX_YAML_DEPTH = 32
MAX_INT = 2**63 - 1
"""Every integer key fits the int64 that torch and the file formats store it in."""
MAX_MODEL_DIM = 1 << 20
"""Larger model dimensions cannot be allocated on any machine (hidden_size=1e23 would fail deep in torch)."""


class _RefusedYaml(yaml.YAMLError):
    """A document the bounded loader refuses; the message says why."""


class BoundedYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with limits on aliases and nesting ("billion laughs" and stack bombs are
    refused while composing, before anything is built) and with duplicate keys an error."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _RefusedYaml(f"more than {MAX_YAML_ALIASES} aliases (*name)")
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _RefusedYaml(f"nested deeper than {MAX_YAML_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner reads a flow collection ahead to its end before the composer sees any of it: a
        # megabyte of "[" is refused here, at the first bracket too many, rather than after the scan.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise _RefusedYaml(f"nested deeper than {MAX_YAML_DEPTH} levels")
        super().fetch_flow_collection_start(TokenClass)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _RefusedYaml(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parses YAML with ``BoundedYamlLoader``; raises ``yaml.YAMLError`` (a ``_RefusedYaml`` saying why)."""
    loader = BoundedYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise _RefusedYaml(f"more than {MAX_YAML_NODES} values once its aliases are expanded")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` stands for with aliases expanded; shared nodes are counted once each time
    they are used, but computed once (depth is already bounded by the loader)."""
    if id(node) in sizes:
        return sizes[id(node)]
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = size
    return size


NO_FILE = "--set"
"""The source of a configuration made of defaults and ``--set`` items only."""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The configuration of ``path`` (YAML) with the ``--set`` items ``overrides`` applied in order. A
    ``ConfigError`` names the source at fault: the file, or the ``--set`` item that set the key."""
    file_source = str(path) if path is not None else NO_FILE
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    raw = translate_reference_keys(raw, file_source)
    return with_overrides(_build(RunConfig, raw, prefix="", sources=KeySources(file_source, {})), overrides,
                          file_source)


def with_overrides(config: RunConfig, overrides: Sequence[str], source: str = NO_FILE) -> RunConfig:
    """A new configuration: ``config`` with the ``--set`` items ``overrides`` applied in order, each typed
    and the whole checked as a file is. ``source`` names where ``config`` came from (its file, or
    ``NO_FILE``): a ``ConfigError`` names it, or the ``--set`` item that set the key at fault, or the
    items when ``config`` alone is valid and they made the combination fail."""
    raw = config_to_dict(config)
    sources = KeySources(source, {_apply_override(raw, item): item for item in overrides})
    merged = _build(RunConfig, raw, prefix="", sources=sources)
    try:
        validate(merged, source)
    except ConfigError:
        if not overrides or source == NO_FILE or not _valid(config, source):
            raise
        # the configuration alone is valid: an override made the combination fail
        validate(merged, "--set " + " ".join(repr(item) for item in overrides))
    return merged


@dataclass(frozen=True)
class KeySources:
    """Where each key of a configuration came from: the file, or the ``--set`` item that set it or a
    section above it (so an error about a key typed after ``--set`` never blames the file)."""

    file: str
    overrides: dict[str, str]  # dotted key -> its --set item

    def of(self, key: str) -> str:
        parts = key.split(".")
        for end in range(len(parts), 0, -1):
            item = self.overrides.get(".".join(parts[:end]))
            if item is not None:
                return f"--set {item!r}"
        return self.file


def _valid(config: RunConfig, source: str) -> bool:
    try:
        validate(config, source)
    except ConfigError:
        return False
    return True


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = read_regular_text(path.resolve(), MAX_CONFIG_BYTES)  # a link to a config is fine; a FIFO is not
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = load_yaml(text)
    except _RefusedYaml as exc:
        raise ConfigError(f"config file {path} refused: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} refused: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def _apply_override(raw: dict[str, Any], item: str) -> str:
    """Sets the key of ``item`` (``section.key=value``) in ``raw``; returns the dotted key."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = load_yaml(text) if text.strip() else None
    except _RefusedYaml as exc:
        raise ConfigError(f"--set {item!r}: {exc}") from None
    except (yaml.YAMLError, RecursionError):
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value
    return ".".join(parts)


def _build(cls: type, raw: Any, prefix: str, sources: KeySources) -> Any:
    if not isinstance(raw, dict):
        section = prefix.rstrip('.')
        raise ConfigError(f"{sources.of(section)}: config key {section or '<root>'!r} must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{sources.of(prefix + str(key))}: unknown config key {prefix + str(key)!r}")
    values = {}
    for name in fields:
        if name not in raw:
            continue
        hint = hints[name]
        full_key = prefix + name
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name] if raw[name] is not None else {}, full_key + ".", sources)
        else:
            values[name] = _coerce(raw[name], hint, full_key, sources.of(full_key))
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{source}: config key {key!r} must not be empty")
    base = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(base) in (tuple, list):
        # sequences are checked element by element by their section's own validate()
        if isinstance(value, (list, tuple, str)):
            return value
        raise ConfigError(f"{source}: config key {key!r} must be a list, got {value!r}")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise ConfigError(f"{source}: config key {key!r} must fit in 64 bits, got a {len(str(abs(value)))}-digit integer")
            return value
    elif base is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
    elif base is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{source}: config key {key!r} must be {base.__name__}, got {value!r}")


def validate(config: RunConfig, source: str = "<config>") -> None:
    """Range checks that the type system does not express."""

    def positive(key: str, value: int | float | None, allow_zero: bool = False) -> None:
        if value is None:
            return
        if value < 0 or (value == 0 and not allow_zero):
            bound = "≥ 0" if allow_zero else "> 0"
            raise ConfigError(f"{source}: config key {key!r} must be {bound}, got {value!r}")

    def at_most(key: str, value: int | None, bound: int) -> None:
        if value is not None and value > bound:
            raise ConfigError(f"{source}: config key {key!r} must be ≤ {bound}, got {value!r}")

    if config.model.preset not in PRESETS:
        raise ConfigError(
            f"{source}: config key 'model.preset' must be one of {sorted(PRESETS)}, got {config.model.preset!r}"
        )
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        positive(f"model.{name}", getattr(config.model, name))
        at_most(f"model.{name}", getattr(config.model, name), MAX_MODEL_DIM)
    positive("data.seq_len", config.data.seq_len)
    positive("data.micro_batch_size", config.data.micro_batch_size)
    for name in ("dp_replicate", "dp_shard", "tp", "pp"):
        positive(f"parallel.{name}", getattr(config.parallel, name))
    positive("optim.lr", config.optim.lr)
    positive("optim.warmup_steps", config.optim.warmup_steps, allow_zero=True)
    positive("optim.decay_steps", config.optim.decay_steps)
    positive("optim.weight_decay", config.optim.weight_decay, allow_zero=True)
    positive("optim.grad_clip", config.optim.grad_clip, allow_zero=True)
    positive("optim.eps", config.optim.eps)
    if not 0 <= config.optim.min_lr_ratio <= 1:
        raise ConfigError(f"{source}: config key 'optim.min_lr_ratio' must be in [0, 1], got {config.optim.min_lr_ratio!r}")
    for name in ("beta1", "beta2"):
        beta = getattr(config.optim, name)
        if not 0 <= beta < 1:
            raise ConfigError(f"{source}: config key 'optim.{name}' must be in [0, 1), got {beta!r}")
    positive("train.steps", config.train.steps)
    positive("train.micro_batches", config.train.micro_batches)
    positive("train.log_interval", config.train.log_interval)
    positive("train.exit_at_step", config.train.exit_at_step, allow_zero=True)
    positive("checkpoint.save_interval", config.checkpoint.save_interval, allow_zero=True)
    positive("checkpoint.keep_last", config.checkpoint.keep_last)
    positive("checkpoint.keep_every", config.checkpoint.keep_every)
    positive("checkpoint.local_interval", config.checkpoint.local_interval, allow_zero=True)
    positive("checkpoint.local_keep_last", config.checkpoint.local_keep_last)
    positive("checkpoint.memory_interval", config.checkpoint.memory_interval, allow_zero=True)
    positive("checkpoint.memory_keep_last", config.checkpoint.memory_keep_last)
    if config.checkpoint.writer not in WRITERS:
        raise ConfigError(f"{source}: config key 'checkpoint.writer' must be one of {', '.join(WRITERS)}, "
                          f"got {config.checkpoint.writer!r}")
    positive("parallel.ranks_per_node", config.parallel.ranks_per_node)
    validate_mirror_config(config.checkpoint.mirror, source)
    skip, health = config.guards.skip, config.guards.health
    if config.guards.check_for_global_norm and skip.enabled:
        raise ConfigError(
            f"{source}: guards.check_for_global_norm (monitor_config.check_for_global_norm, rollback mode) and "
            "guards.skip.enabled (use_skip_data_by_global_norm, data skip) are mutually exclusive"
        )
    config.guards.rollback.validate(source)
    positive("guards.skip.threshold (global_norm_spike_threshold)", skip.threshold)
    positive("guards.skip.count_threshold (global_norm_spike_count_threshold)", skip.count_threshold)
    positive("guards.skip.window", skip.window)
    positive("guards.skip.z_threshold", skip.z_threshold)
    positive("guards.skip.warmup", skip.warmup, allow_zero=True)
    positive("guards.skip.regime_steps", skip.regime_steps, allow_zero=True)
    if skip.mode not in ("absolute", "adaptive"):
        raise ConfigError(f"{source}: config key 'guards.skip.mode' must be 'absolute' or 'adaptive', got {skip.mode!r}")
    positive("guards.health.embedding_threshold (embedding_local_norm_threshold)", health.embedding_threshold)
    positive("guards.max_consecutive_skips", config.guards.max_consecutive_skips, allow_zero=True)
    config.guards.sdc.validate()
    config.guards.fingerprint.validate()
    config.lifecycle.validate(source)
    positive("fault_tolerance.spares", config.fault_tolerance.spares, allow_zero=True)
    positive("fault_tolerance.hang_s", config.fault_tolerance.hang_s)
    positive("fault_tolerance.startup_s", config.fault_tolerance.startup_s)
    positive("fault_tolerance.collective_timeout_s", config.fault_tolerance.collective_timeout_s)
    positive("fault_tolerance.stall_s", config.fault_tolerance.stall_s)
    positive("fault_tolerance.stall_steps", config.fault_tolerance.stall_steps)
    positive("fault_tolerance.max_step_failures", config.fault_tolerance.max_step_failures)
    positive("fault_tolerance.max_start_failures", config.fault_tolerance.max_start_failures)
    sdc_config_from_env(config.guards.sdc)
    pp = config.parallel.pp or 1
    if pp > 1 and config.train.micro_batches < pp:
        raise ConfigError(
            f"{source}: micro_batch_num (train.micro_batches={config.train.micro_batches}) must be ≥ "
            f"pipeline_stage (parallel.pp={pp})"
        )
    if config.model.init_from is not None:
        from trainguard.hf.config import MODEL_KEYS, check_init_from

        explicit = {key: getattr(config.model, key) for key in MODEL_KEYS}
        check_init_from(Path(config.model.init_from), config.model.attn_implementation, explicit, pp, source,
                        tp=config.parallel.tp or 1)
    else:
        check_preset_fits(config, source)
    from trainguard.faults import active_faults

    active_faults(config.faults)


def check_preset_fits(config: RunConfig, source: str) -> None:
    """The ``model.*`` keys and ``parallel.*`` degrees set must suit the preset's model type (GPT-2 has no
    ``num_kv_heads`` and trains with FSDP2 / HSDP only: ``hf.model_types``)."""
    from trainguard.hf.model_types import check_model_keys, check_parallel_support

    model_type = PRESETS[config.model.preset].get("model_type", "llama")
    try:
        check_model_keys(model_type, dataclasses.asdict(config.model))
        check_parallel_support(model_type, {"tp": config.parallel.tp, "pp": config.parallel.pp})
    except ConfigError as exc:
        raise ConfigError(f"{source}: model.preset={config.model.preset}: {exc}") from None


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
