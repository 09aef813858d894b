"""Writing fused expert tensors in the Hugging Face checkpoint format, one tensor per expert, streaming.

A checkpoint holds a Mixtral model as transformers keeps it in memory (``mlp.experts.gate_up_proj``
[E, 2I, H] ...); ``from_pretrained`` and vLLM read per-expert tensors (``hf.fused_experts``). Those
tile the fused tensor in its byte order, so the merge streams the fused tensor as it streams any
tensor (FSDP's row blocks, a few experts at a time) and cuts the stream into the per-expert tensors:
no fused tensor is ever assembled whole, and no byte is copied twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from trainguard.hf.fused_experts import StoredTensor, stored_tensors
from trainguard.merge.pieces import ShardedTensor


def stored_layout(model_type: str, outputs: list[tuple[str, ShardedTensor]]) -> list[list[StoredTensor]]:
    """For each (model name, tensor) of a merge plan, the checkpoint tensors that store it."""
    return [stored_tensors(model_type, name, tensor.shape) for name, tensor in outputs]


def _runs(parts: Iterable[torch.Tensor], sizes: list[int]) -> Iterator[Iterator[torch.Tensor]]:
    """The elements of ``parts`` (one after another) as consecutive runs of ``sizes`` elements, each run
    as flat views of the parts; each run must be consumed before the next is taken."""
    parts = iter(parts)
    rest = torch.empty(0)

    def run(size: int) -> Iterator[torch.Tensor]:
        nonlocal rest
        while size:
            if not rest.numel():
                rest = next(parts).reshape(-1)
            piece, rest = rest[:size], rest[size:]
            size -= piece.numel()
            yield piece

    for size in sizes:
        yield run(size)


def split_stream(streams: Iterable[Iterable[torch.Tensor]],
                 layout: list[list[StoredTensor]]) -> Iterator[Iterable[torch.Tensor]]:
    """``streams`` (each model tensor's parts, as ``merger.stream_tensor_parts`` gives them) as the parts
    of each stored tensor of ``layout`` in turn."""
    for parts, stored in zip(streams, layout):
        if len(stored) == 1:
            yield parts
        else:
            yield from _runs(parts, [part.numel for part in stored])
