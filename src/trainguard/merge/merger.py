"""``merge_to_hf``: any supported checkpoint -> a Hugging Face directory, streaming one tensor at a time.

Memory stays near the largest full tensor (plus up to ``PREFETCH`` assembled ahead and the read
buffers), never the model: the safetensors headers are planned from shapes, then each tensor is
assembled from its pieces (read in parallel) while the previous one is being written.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from trainguard.fs.layout import HF_DIR
from trainguard.errors import CheckpointError
from trainguard.merge.hf_layout import DTYPE_NAMES, MergePlan, load_config, plan_merge
from trainguard.merge.pieces import Piece, ShardedTensor, assemble, read_piece
from trainguard.merge.read_ranks import rank_file_dirs
from trainguard.merge.safetensors_out import OutputTensor, write_safetensors
from trainguard.merge.source import open_checkpoint
from trainguard.merge.split_experts import split_stream, stored_layout
from trainguard.merge.target import check_target, staged_directory
from trainguard.topology.group_info import GROUP_INFO_NAME

READ_THREADS = 4
PREFETCH = 1
# weights of the model --hf_config names (verl's --hf_model_path is a whole model): never copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")


@dataclass(frozen=True)
class MergeResult:
    files: list[str]
    tensors: int
    bytes: int
    source: str


def row_blocks(tensor: ShardedTensor) -> list[Piece] | None:
    """The pieces in order when they split the tensor in whole rows only (FSDP's ``Shard(0)``): then the
    tensor's bytes are just its pieces' bytes one after another, and no full copy is ever needed."""
    if not tensor.shape or any(piece.sizes[1:] != tensor.shape[1:] for piece in tensor.pieces):
        return None
    pieces = sorted(tensor.pieces, key=lambda piece: piece.offsets[0])
    row = 0
    for piece in pieces:
        if piece.offsets[0] != row:
            return None
        row += piece.sizes[0]
    return pieces if row == tensor.shape[0] else None


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def stream_tensor_parts(tensors: list[ShardedTensor], dtype: torch.dtype | None = None, *, by_rows: bool = True,
                        threads: int = READ_THREADS, prefetch: int = PREFETCH) -> Iterator[Iterator[torch.Tensor]]:
    """For each tensor in order, its contents as consecutive parts: its row blocks read one at a time
    (``by_rows``, where the pieces allow), else the whole tensor, assembled from its pieces (read in
    parallel) while earlier tensors are being consumed."""
    with ThreadPoolExecutor(threads, thread_name_prefix="read") as pieces, \
            ThreadPoolExecutor(1, thread_name_prefix="assemble") as ahead:
        rows = [row_blocks(t) if by_rows else None for t in tensors]
        to_assemble = deque(i for i, blocks in enumerate(rows) if blocks is None)
        pending: dict[int, Future] = {}

        def submit_ahead() -> None:
            while to_assemble and len(pending) <= prefetch:
                i = to_assemble.popleft()
                pending[i] = ahead.submit(lambda t=tensors[i]: _cast(assemble(t, pieces), dtype))

        for i, tensor in enumerate(tensors):
            submit_ahead()
            if rows[i] is not None:
                yield (_cast(read_piece(tensor, piece), dtype) for piece in rows[i])
            else:
                full = pending.pop(i).result()
                submit_ahead()
                yield iter([full])
                del full


def stream_full_tensors(tensors: list[ShardedTensor], dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """The full tensors in order (at most ``PREFETCH`` assembled ahead)."""
    for parts in stream_tensor_parts(tensors, dtype, by_rows=False):
        yield next(parts)


def hf_dir_of(checkpoint: Path) -> Path:
    """The checkpoint's ``huggingface/`` (config, tokenizer): in its directory, or for a local-tier step
    in the same step of another node, or beside the steps (where local directories written before it
    moved into each step keep it)."""
    candidates = [checkpoint / HF_DIR]
    if (checkpoint.parent / GROUP_INFO_NAME).is_file():
        steps = rank_file_dirs(checkpoint)
        candidates += [d / HF_DIR for d in steps] + [d.parent / HF_DIR for d in steps]
    return next((c for c in candidates if (c / "config.json").is_file()), candidates[0])


def _check_tied(plan: MergePlan) -> None:
    if plan.check_tied is None:
        return
    embedding, output = plan.check_tied
    if not torch.equal(assemble(embedding), assemble(output)):
        raise CheckpointError(f"--tie-word-embedding: {output.key} differs from {embedding.key} in this "
                              "checkpoint (trained untied); tying them would change the model")


def merge_to_hf(local_dir: Path, target_dir: Path, *, backend: str = "auto", tie_word_embedding: bool = False,
                is_value_model: bool = False, dtype: str = "keep", max_shard_bytes: int = 5 * 10**9,
                force: bool = False, progress: Callable[[int, str], Callable[[int], None]] | None = None,
                hf_config: Path | None = None) -> MergeResult:
    """``progress(total_bytes, description)`` returns the callback advanced as bytes are written.
    ``hf_config``: the directory whose ``config.json`` (and tokenizer files) describe the model, for a
    checkpoint without ``huggingface/``; it wins over the checkpoint's own."""
    local_dir, target_dir = Path(local_dir), Path(target_dir)
    check_target(target_dir, force)  # before any reading: a wrong target fails at once
    contents = open_checkpoint(local_dir, backend)
    hf_dir = Path(hf_config) if hf_config is not None else hf_dir_of(local_dir)
    config = load_config(hf_dir)
    plan = plan_merge(contents, config, tie_word_embedding, is_value_model, DTYPE_NAMES[dtype])
    _check_tied(plan)
    out_dtype = getattr(torch, DTYPE_NAMES[dtype]) if DTYPE_NAMES[dtype] else None
    layout = stored_layout(plan.config["model_type"], plan.outputs)  # fused experts: one tensor per expert
    outputs = [OutputTensor(part.name, part.shape, out_dtype if out_dtype and tensor.dtype.is_floating_point
                            else tensor.dtype) for (_, tensor), parts in zip(plan.outputs, layout) for part in parts]
    total = sum(t.nbytes for t in outputs)
    advance = progress(total, f"merging {len(outputs)} tensors") if progress else (lambda n: None)
    with staged_directory(target_dir, force) as staging:
        for path in sorted(hf_dir.iterdir()):
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(path, staging / path.name)
        (staging / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")
        streams = stream_tensor_parts([t for _, t in plan.outputs], out_dtype)
        files = write_safetensors(staging, outputs, split_stream(streams, layout), max_shard_bytes, advance)
    return MergeResult(files, len(outputs), total, contents.description)
