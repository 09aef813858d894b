"""``merge_to_hf``: any supported checkpoint -> a Hugging Face directory, streaming one tensor at a time.

Memory stays near the largest full tensor (plus up to ``PREFETCH`` assembled ahead and the read
buffers), never the model: the safetensors headers are planned from shapes, then each tensor is
assembled from its pieces (read in parallel) while the previous one is being written.
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from trainguard.errors import CheckpointError
from trainguard.merge.hf_layout import DTYPES, MergePlan, load_config, plan_merge
from trainguard.merge.pieces import ShardedTensor, assemble
from trainguard.merge.safetensors_out import OutputTensor, write_safetensors
from trainguard.merge.source import open_checkpoint
from trainguard.merge.target import check_target, staged_directory

HF_DIR = "huggingface"
READ_THREADS = 4
PREFETCH = 2


@dataclass(frozen=True)
class MergeResult:
    files: list[str]
    tensors: int
    bytes: int
    source: str


def stream_full_tensors(tensors: list[ShardedTensor], dtype: torch.dtype | None = None,
                        threads: int = READ_THREADS, prefetch: int = PREFETCH) -> Iterator[torch.Tensor]:
    """The full tensors in order, each assembled while earlier ones are being consumed."""
    with ThreadPoolExecutor(threads, thread_name_prefix="read") as pieces, \
            ThreadPoolExecutor(1, thread_name_prefix="assemble") as ahead:
        def job(tensor: ShardedTensor) -> torch.Tensor:
            full = assemble(tensor, pieces)
            return full if dtype is None or not full.is_floating_point() else full.to(dtype)

        queue: deque = deque()
        todo = iter(tensors)
        for tensor in todo:
            queue.append(ahead.submit(job, tensor))
            if len(queue) > prefetch:
                break
        while queue:
            result = queue.popleft().result()
            next_tensor = next(todo, None)
            if next_tensor is not None:
                queue.append(ahead.submit(job, next_tensor))
            yield result
            del result


def _check_tied(plan: MergePlan) -> None:
    if plan.check_tied is None:
        return
    embedding, output = plan.check_tied
    if not torch.equal(assemble(embedding), assemble(output)):
        raise CheckpointError(f"--tie-word-embedding: {output.key} differs from {embedding.key} in this "
                              "checkpoint (trained untied); tying them would change the model")


def merge_to_hf(local_dir: Path, target_dir: Path, *, backend: str = "auto", tie_word_embedding: bool = False,
                is_value_model: bool = False, dtype: str = "keep", max_shard_bytes: int = 5 * 10**9,
                force: bool = False, progress: Callable[[int, str], Callable[[int], None]] | None = None
                ) -> MergeResult:
    """``progress(total_bytes, description)`` returns the callback advanced as bytes are written."""
    local_dir, target_dir = Path(local_dir), Path(target_dir)
    check_target(target_dir, force)  # before any reading: a wrong target fails at once
    contents = open_checkpoint(local_dir, backend)
    hf_dir = local_dir / HF_DIR
    config = load_config(hf_dir)
    plan = plan_merge(contents, config, tie_word_embedding, is_value_model)
    _check_tied(plan)
    out_dtype = DTYPES[dtype]
    outputs = [OutputTensor(name, tensor.shape, out_dtype if out_dtype and tensor.dtype.is_floating_point
                            else tensor.dtype) for name, tensor in plan.outputs]
    total = sum(t.nbytes for t in outputs)
    advance = progress(total, f"merging {len(outputs)} tensors") if progress else (lambda n: None)
    with staged_directory(target_dir, force) as staging:
        for path in sorted(hf_dir.iterdir()):
            if path.is_file():
                shutil.copy2(path, staging / path.name)
        if out_dtype is not None:
            plan.config.dtype = out_dtype
        plan.config.save_pretrained(staging)
        files = write_safetensors(staging, outputs, stream_full_tensors([t for _, t in plan.outputs], out_dtype),
                                  max_shard_bytes, advance)
    return MergeResult(files, len(outputs), total, contents.description)
