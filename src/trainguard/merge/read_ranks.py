"""Per-rank checkpoints as pieces: trainguard local checkpoints and verl's FSDP checkpoints.

Both are ``model_world_size_W_rank_R.pt`` (+ ``optim_...``, ``extra_state_...``) and
``fsdp_config.json``. trainguard's local tier describes the layout of the whole mesh in
``fsdp_config.json`` (``mesh_shape``, ``params: {fqn: {shape, dtype, placements}}``), which is what is
read here (its model files hold DTensors over verl's mesh names too, for verl's own merger); verl's
files are read by their DTensors, whose pickled mesh and placements describe themselves; plain tensors
in a verl file mean a 1-D mesh sharded on dim 0. Files are loaded with ``weights_only=True`` (DTensor
classes allow-listed explicitly) and memory-mapped, once each, so reading one tensor touches only its pages; the pages read
are given back after every ``_MAPPED_BUDGET`` bytes, which keeps the resident set bounded.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.errors import CheckpointError
from trainguard.merge import mapped_pages
from trainguard.merge.pieces import CheckpointContents, Piece, ShardedTensor
from trainguard.merge.placement import Placement, coordinate, local_block, parse_placement, placement_of, SHARD
from trainguard.topology.group_info import GROUP_INFO_NAME, read_group_info

FSDP_CONFIG = "fsdp_config.json"
_RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt")
_MAPPED_BUDGET = 64 << 20


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (``{"state": {"w": {"exp_avg": t}}}`` -> ``state.w.exp_avg``)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"expected a dict of tensors, found {type(state).__name__}")
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


class _MappedFiles:
    """Memory-mapped rank files, each loaded once; after every ``budget`` bytes handed out, the pages
    read so far are given back (``mapped_pages``), which keeps the resident set bounded."""

    def __init__(self, budget: int = _MAPPED_BUDGET, param_order: Callable[[], list[str]] | None = None):
        self._budget = budget
        self._param_order = param_order
        self._names: list[str] | None = None
        self._files: dict[Path, dict[str, Any]] = {}
        self._mappings: list[tuple[int, int]] = []
        self._read = 0
        self._lock = threading.Lock()

    def content(self, path: Path) -> dict[str, Any]:
        with self._lock:
            content = self._files.get(path)
            if content is None:
                content = self._files[path] = flatten(self._by_name(safe_torch_load(path, mmap=True), path))
                self._mappings += mapped_pages.private_read_mappings(path)
            return content

    def _by_name(self, state: Any, path: Path) -> Any:
        if not _index_keyed(state):
            return state
        if self._param_order is None:
            raise CheckpointError(f"{path}: optimizer state keyed by parameter index; naming it needs the "
                                  "model's parameter order (its huggingface/config.json)")
        if self._names is None:
            self._names = self._param_order()
        return optimizer_by_name(state, self._names, path)

    def tensor(self, path: Path, key: str) -> torch.Tensor:
        value = self.content(path).get(key)
        if value is None:
            raise CheckpointError(f"{path}: has no tensor {key!r}")
        local = value.to_local() if hasattr(value, "to_local") else value
        with self._lock:
            self._read += local.numel() * local.element_size()
            if self._read > self._budget:
                mapped_pages.release(self._mappings)
                self._read = 0
        return local


@dataclass(frozen=True)
class RankFiles:
    world_size: int
    model: list[Path]
    optim: list[Path]
    extra: list[Path]


def rank_file_dirs(directory: Path) -> list[Path]:
    """The directories holding the files of the per-rank checkpoint ``directory``: itself and, for a step
    of trainguard's local tier (``LOCAL/nodeK/global_step_N``, ``group_info.json`` next to it), the same
    step of every other local directory of the run (each node keeps only its own ranks' files): those
    ``group_info.json`` records in ``rank_dirs`` while ``directory`` is where the run wrote it, else (the
    directories copied or moved elsewhere) its siblings that have a ``group_info.json``."""
    directory = Path(directory)
    info = directory.parent / GROUP_INFO_NAME
    if not info.is_file():
        return [directory]
    recorded = {Path(d).resolve() for d in read_group_info(info).rank_dirs.values()}
    local_dir = directory.parent.resolve()
    if local_dir not in recorded:
        recorded = {p.parent.resolve() for p in local_dir.parent.glob(f"*/{GROUP_INFO_NAME}")}
    others = sorted(d / directory.name for d in recorded - {local_dir})
    return [directory] + [d for d in others if d.is_dir()]


def find_rank_files(directory: Path) -> RankFiles:
    """The per-rank files of one checkpoint (gathered from every node's directory for a local-tier step,
    see ``rank_file_dirs``); a missing rank or mixed world sizes is an error naming a file."""
    found: dict[str, dict[int, dict[int, Path]]] = {}
    for path in (p for d in reversed(rank_file_dirs(directory)) for p in sorted(d.iterdir())):
        if match := _RANK_FILE.fullmatch(path.name):  # a rank found in several directories: the given one's
            kind, world, rank = match.group(1), int(match.group(2)), int(match.group(3))
            found.setdefault(kind, {}).setdefault(world, {})[rank] = path
    if "model" not in found:
        raise CheckpointError(f"{directory}: no model_world_size_W_rank_R.pt files (not a per-rank checkpoint)")
    worlds = sorted({world for per_world in found.values() for world in per_world})
    if len(worlds) > 1:
        examples = [next(iter(found[k][w].values())).name for k in found for w in worlds if w in found[k]][:2]
        raise CheckpointError(f"{directory}: files of different world sizes {worlds} mixed "
                              f"({examples[0]} and {examples[-1]}); keep one checkpoint per directory")
    world = worlds[0]

    def complete(kind: str, required: bool) -> list[Path]:
        ranks = found.get(kind, {}).get(world, {})
        if not ranks and not required:
            return []
        for rank in range(world):
            if rank not in ranks:
                raise CheckpointError(f"{directory / f'{kind}_world_size_{world}_rank_{rank}.pt'}: missing "
                                      f"(the checkpoint was saved by {world} ranks)")
        extra = sorted(set(ranks) - set(range(world)))
        if extra:
            raise CheckpointError(f"{ranks[extra[0]]}: rank {extra[0]} is outside world size {world}")
        return [ranks[rank] for rank in range(world)]

    return RankFiles(world, complete("model", True), complete("optim", False), complete("extra_state", False))


def read_fsdp_config(directory: Path) -> dict[str, Any] | None:
    path = directory / FSDP_CONFIG
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def _layout_from_config(path: Path, config: dict[str, Any], world: int):
    try:
        mesh_shape = tuple(int(n) for n in config["mesh_shape"])
        names = [str(n) for n in config.get("mesh_dim_names", [f"dim{i}" for i in range(len(mesh_shape))])]
        params = {
            fqn: (tuple(int(n) for n in spec["shape"]), tuple(parse_placement(p) for p in spec["placements"]))
            for fqn, spec in config["params"].items()
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
    for fqn, (_, placements) in params.items():
        if len(placements) != len(mesh_shape):
            raise CheckpointError(f"{path}: {fqn} has {len(placements)} placements for the {len(mesh_shape)}-D "
                                  f"mesh {list(mesh_shape)} (one per mesh dim expected)")
    if int(torch.tensor(mesh_shape).prod()) != world:
        raise CheckpointError(f"{path}: mesh_shape {list(mesh_shape)} does not hold the {world} ranks whose files are here")
    return mesh_shape, names, params


class _Builder:
    """Collects each rank's blocks into ShardedTensors; identical blocks (replicas) are read once."""

    def __init__(self, files: _MappedFiles):
        self.files = files
        self.tensors: dict[str, ShardedTensor] = {}
        self._seen: dict[str, set] = {}

    def add(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, block, path: Path, file_key: str,
            local_shape: tuple[int, ...]) -> None:
        tensor = self.tensors.setdefault(key, ShardedTensor(key, shape, dtype))
        if tensor.shape != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{path}: {file_key} is {list(shape)} {dtype} here but "
                                  f"{list(tensor.shape)} {tensor.dtype} in another rank's file")
        offsets, sizes = tuple(s for s, _ in block), tuple(n for _, n in block)
        if sizes != local_shape:
            raise CheckpointError(f"{path}: {file_key} has local shape {list(local_shape)}, but its placement "
                                  f"gives a block of {list(sizes)} of global shape {list(shape)}")
        if (offsets, sizes) in self._seen.setdefault(key, set()):
            return  # a replica of a block already taken: never concatenated
        self._seen[key].add((offsets, sizes))
        tensor.pieces.append(Piece(offsets, sizes, lambda p=path, k=file_key: self.files.tensor(p, k), path.name))


def _add_local_file(builder: _Builder, prefix: str, path: Path, rank: int, content: dict[str, Any], layout,
                    config_path: Path) -> dict[str, Any]:
    """A trainguard local rank file: plain tensors, placed by fsdp_config.json. Returns its non-tensors."""
    mesh_shape, _, params = layout
    coord = coordinate(rank, mesh_shape)
    objects = {}
    for key, value in content.items():
        if not isinstance(value, torch.Tensor):
            objects[prefix + key] = value
            continue
        if hasattr(value, "to_local"):  # a DTensor (model files): its local shard is what is placed
            value = value.to_local()
        local_shape = tuple(value.shape)
        fqn = key if prefix == "model." else _optimizer_param(key)
        if fqn in params and value.dim() > 0:
            shape, placements = params[fqn]
            block = local_block(shape, mesh_shape, placements, coord)
        elif prefix == "optim." and value.dim() == 0:
            shape, block = (), ()  # a scalar (the step count): the same on every rank
        else:
            raise CheckpointError(f"{path}: {key} is not described in {config_path}")
        builder.add(prefix + key, shape, value.dtype, block, path, key, local_shape)
    return objects


def _optimizer_param(key: str) -> str:
    """``state.<fqn>.exp_avg`` -> ``<fqn>`` (optimizer state keyed by parameter name)."""
    return key[len("state."):].rsplit(".", 1)[0] if key.startswith("state.") else key


def _mesh_of(device_mesh, rank: int, path: Path, key: str) -> torch.Tensor:
    """The ranks of the (sub)mesh that ``rank`` belongs to. ``DeviceMesh.mesh`` asks the process group
    for the current rank, which an offline reader has not got: the file's rank is passed instead. A mesh
    pickled under torch before 2.10 holds that (sub)mesh's ranks whole, under its ``mesh`` attribute."""
    state = vars(device_mesh)
    if "_layout" not in state and isinstance(state.get("mesh"), torch.Tensor):
        return state["mesh"]
    try:
        full = device_mesh._layout.remap_to_tensor(device_mesh._rank_map)
        return type(device_mesh)._get_mesh_tensor_from_full_mesh(full, rank)
    except (AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot read the device mesh of {key} ({exc})") from None


def _add_verl_file(builder: _Builder, prefix: str, path: Path, rank: int, world: int,
                   content: dict[str, Any], plain_sizes: dict[str, list[int]]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    objects = {}
    for key, value in content.items():
        if isinstance(value, DTensor):
            mesh = _mesh_of(value.device_mesh, rank, path, key)
            where = (mesh == rank).nonzero()
            if where.numel() == 0:
                raise CheckpointError(f"{path}: {key} lives on mesh {mesh.tolist()}, which does not hold rank {rank}")
            placements = tuple(placement_of(p) for p in value.placements)
            coord = tuple(int(c) for c in where[0])
            block = local_block(tuple(value.shape), tuple(mesh.shape), placements, coord)
            builder.add(prefix + key, tuple(value.shape), value.dtype, block, path, key, tuple(value.to_local().shape))
        elif isinstance(value, torch.Tensor):
            # only the shape and dtype: keeping the tensor would keep its file mapped
            plain_sizes.setdefault(prefix + key, [None] * world)[rank] = torch.empty(value.shape, dtype=value.dtype, device="meta")
        else:
            objects[prefix + key] = value
    return objects


def _add_plain_tensors(builder: _Builder, paths: dict[str, list[Path]], plain: dict[str, list]) -> None:
    """Plain tensors in verl files: a 1-D mesh over all ranks, Shard(0) (scalars: replicated)."""
    for key, locals_ in plain.items():
        world = len(locals_)
        first = locals_[0]
        if first.dim() == 0:
            builder.add(key, (), first.dtype, (), paths[key][0], key.split(".", 1)[1], ())
            continue
        shape = (sum(t.shape[0] for t in locals_), *first.shape[1:])
        for rank, local in enumerate(locals_):
            block = local_block(shape, (world,), (Placement(SHARD, 0),), (rank,))
            builder.add(key, shape, first.dtype, block, paths[key][rank], key.split(".", 1)[1], tuple(local.shape))


def _index_keyed(state: Any) -> bool:
    return (isinstance(state, dict) and set(state) == {"state", "param_groups"}
            and isinstance(state["param_groups"], list) and all(isinstance(k, int) for k in state["state"]))


def optimizer_by_name(state: dict[str, Any], names: list[str], path: Path) -> dict[str, Any]:
    """verl's optimizer files are ``optimizer.state_dict()``: the state and the param groups' ``params``
    keyed by each parameter's index in the model's parameter order (``model.parameters()``, a tied
    weight once). Returned under the durable tier's keys: ``state.<fqn>.<exp_avg|exp_avg_sq|step>``,
    ``param_groups.<fqn>.<hyperparameter>``."""
    indices = [index for group in state["param_groups"] for index in group.get("params", [])]
    if sorted(indices) != list(range(len(names))):
        raise CheckpointError(f"{path}: the optimizer's param groups list {len(indices)} parameters, the model "
                              f"of huggingface/config.json has {len(names)}: not this model's optimizer")
    named: dict[str, Any] = {}
    for index, entry in state["state"].items():
        if index not in indices or not isinstance(entry, dict):
            raise CheckpointError(f"{path}: optimizer state for parameter index {index!r}, which no param group lists")
        named.update({f"state.{names[index]}.{key}": value for key, value in entry.items()})
    for group in state["param_groups"]:
        settings = {key: value for key, value in group.items() if key != "params"}
        for index in group["params"]:
            named.update({f"param_groups.{names[index]}.{key}": value for key, value in settings.items()})
    return named


def open_rank_checkpoint(directory: Path, include_optimizer: bool = False,
                         param_order: Callable[[], list[str]] | None = None) -> CheckpointContents:
    """A per-rank checkpoint (trainguard local or verl FSDP) as pieces, every rank's file checked.
    ``param_order`` gives the model's parameter names in order, for optimizer files keyed by index."""
    files = find_rank_files(directory)
    config = read_fsdp_config(directory)
    world = files.world_size
    if config is not None and "world_size" in config and int(config["world_size"]) != world:
        raise CheckpointError(f"{directory / FSDP_CONFIG}: world_size {config['world_size']} but the files "
                              f"here were saved by {world} ranks")
    local_layout = None
    if config is not None and "params" in config:
        local_layout = _layout_from_config(directory / FSDP_CONFIG, config, world)
    mapped = _MappedFiles(param_order=param_order)
    builder = _Builder(mapped)
    objects: dict[str, Any] = {}
    plain: dict[str, list] = {}
    plain_paths: dict[str, list[Path]] = {}
    groups = [("model.", files.model)] + ([("optim.", files.optim)] if include_optimizer else [])
    for prefix, paths in groups:
        for rank, path in enumerate(paths):
            content = mapped.content(path)  # memory-mapped: only the pickle is read here
            if local_layout is not None:
                found = _add_local_file(builder, prefix, path, rank, content, local_layout, directory / FSDP_CONFIG)
            else:
                found = _add_verl_file(builder, prefix, path, rank, world, content, plain)
                for key in plain:
                    plain_paths.setdefault(key, list(paths))
            if rank == 0:
                objects.update(found)
            del content
    _add_plain_tensors(builder, plain_paths, plain)
    for tensor in builder.tensors.values():
        tensor.check_coverage()
    if local_layout is not None:
        mesh_shape, names = list(local_layout[0]), list(local_layout[1])
    else:
        mesh_shape, names = [world], ["world"]
    kind = "trainguard local" if local_layout is not None else "verl FSDP"
    return CheckpointContents(builder.tensors, objects, f"{kind} checkpoint {directory} ({world} ranks)",
                              world, mesh_shape, names)
