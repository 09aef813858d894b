"""A Hugging Face model directory as a durable trainguard checkpoint at step 0 (offline, one process).

``hf_to_durable(HF_DIR, DIR)`` writes ``DIR/checkpoints/global_step_0`` (and
``DIR/checkpoints/latest_checkpointed_iteration.txt``), committed like any checkpoint the trainer
writes: DCP files of the model's weights in float32 under the trainer's names (``model.<fqn>``), an
extra-state file, ``huggingface/`` (the config, and the tokenizer files found in HF_DIR), and the
manifest ``trainguard.json`` with every file's checksum, written last, then the directory renamed into
place. It holds no optimizer state, RNG state or data position: a checkpoint of step 0 has none, so a
run that resumes from it (``trainguard train --run-dir DIR`` or ``--resume DIR/checkpoints/global_step_0``,
on any layout) starts its optimizer, schedule, data order and seeds fresh, exactly as a run started
with ``model.init_from=HF_DIR``. That run must build the same architecture: set
``model.init_from=HF_DIR`` too (resume wins over it for the weights).

The whole model is read into this process's memory once (4 bytes per parameter); the trainer's
``model.init_from`` is the way to load without that.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainguard.checkpoint.commit import commit_checkpoint
from trainguard.checkpoint.dcp_writer import ChecksummingFileSystemWriter
from trainguard.checkpoint.manifest import build_manifest
from trainguard.checkpoint.staging import serialised
from trainguard.fs.layout import HF_DIR, extra_state_name, step_dir_name, temp_dir_name
from trainguard.errors import ConfigError
from trainguard.hf.config import hf_tensors, read_hf_config, tensors_to_load, tied_aliases
from trainguard.hf.fused_experts import StoredTensor, model_shape

# copied into huggingface/ when HF_DIR has them, so an export of the checkpoint keeps its tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")


def _read_weights(hf_dir: Path, progress: bool) -> dict[str, torch.Tensor]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from safetensors import safe_open

    config = read_hf_config(hf_dir)
    tensors = hf_tensors(hf_dir)
    to_load = tensors_to_load(config, tensors, hf_dir)
    weights: dict[str, torch.Tensor] = {}
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True, disable=not (progress and console.is_terminal)) as bar:
        task = bar.add_task(f"reading {hf_dir.name}", total=sum(len(parts) for parts in to_load.values()))
        by_file: dict[Path, list[tuple[str, StoredTensor]]] = {}
        for name, parts in to_load.items():
            if len(parts) > 1:  # fused experts: the model tensor, filled block by block from its files
                weights[name] = torch.empty(model_shape(parts), dtype=torch.float32)
            for part in parts:
                by_file.setdefault(tensors[part.name].file, []).append((name, part))
        for file, file_parts in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for name, part in file_parts:
                    tensor = handle.get_tensor(part.name).to(torch.float32)
                    if name in weights:
                        block = weights[name][part.block(weights[name].dim())]
                        block.copy_(tensor.reshape(block.shape))
                    else:
                        weights[name] = tensor
                    bar.advance(task)
    for name, shared in tied_aliases(config).items():  # a tied lm_head: one tensor, as in the model
        weights.setdefault(name, weights[shared])
    return weights


def _write_static_files(hf_dir: Path, directory: Path) -> None:
    target = directory / HF_DIR
    read_hf_config(hf_dir).save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, target / name)


def hf_to_durable(hf_dir: Path, target: Path, *, progress: bool = True) -> Path:
    """Writes ``target/checkpoints/global_step_0`` from ``hf_dir`` and returns its path.

    Raises ``ConfigError`` naming the file or tensor at fault for a bad ``hf_dir``, and when ``target``
    already holds a step-0 checkpoint (never replaced). A crash leaves only a ``global_step_0.tmp-*``
    directory, which is not a checkpoint and is cleaned up by the next run.
    """
    hf_dir, target = Path(hf_dir), Path(target)
    root = target / "checkpoints"
    final = root / step_dir_name(0)
    if final.exists():
        raise ConfigError(f"{final}: already exists; convert into an empty directory")
    weights = _read_weights(hf_dir, progress)
    tmp = root / temp_dir_name(0)
    tmp.mkdir(parents=True)
    writer = ChecksummingFileSystemWriter(tmp)
    with warnings.catch_warnings():  # DCP warns that it saves in a single process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": weights}, storage_writer=writer, no_dist=True)
    # no "rng" and no stateful objects: the resuming run keeps its fresh seeds, schedule and data order
    (tmp / extra_state_name(1, 0)).write_bytes(serialised({"step": 0, "rank": 0, "world_size": 1, "stateful": {}}))
    _write_static_files(hf_dir, tmp)
    manifest = build_manifest(
        tmp, step=0, world_size=1, mesh_shape=[1], mesh_dim_names=["world"],
        trainer_state={"step": 0, "consumed_samples": 0},
        extra={"converted_from": {"huggingface": str(hf_dir.resolve())}}, known=writer.written,
    )
    # the extra state, .metadata and huggingface/ were written plainly: the commit fsyncs them
    return commit_checkpoint(tmp, manifest, fsynced=writer.written).path
