"""Mixture-of-experts tensors (Mixtral, Qwen2-MoE): fused in the model in memory, one tensor per expert
in the checkpoint.

transformers 5 builds a Mixtral layer with its experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I], the router ``mlp.gate.weight`` [E, H]), but ``save_pretrained``
writes, and ``from_pretrained`` and vLLM read, the format Mixtral was published in: per expert,
``block_sparse_moe.experts.K.w1/w3.weight`` [I, H] (gate and up projections) and ``w2.weight`` [H, I],
and the router as ``block_sparse_moe.gate.weight`` (Qwen2-MoE: per expert
``mlp.experts.K.gate_proj/up_proj/down_proj.weight``; its router and shared expert keep their names).
transformers converts between the two on load and save (its ``conversion_mapping``); this module is
the same mapping for trainguard, which reads and writes checkpoints without going through a model.

A model tensor is stored as one or more :class:`StoredTensor`, each a block of it. The blocks of a
fused tensor tile it in its own byte order (expert 0's w1 rows, then its w3 rows, then expert 1's ...),
so writing the stored tensors one after another writes the model tensor's bytes unchanged, and reading
a slice of the model tensor reads only the stored tensors that slice covers. The unit tests check this
mapping against transformers' own ``save_pretrained``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the Hugging Face checkpoint and where it sits in the model's tensor."""

    name: str
    """Its name in the safetensors files."""
    shape: tuple[int, ...]
    """Its shape in the safetensors files."""
    offsets: tuple[int, ...]
    """Where its block starts in the model tensor (one offset per model dimension)."""

    def block_sizes(self, model_ndim: int) -> tuple[int, ...]:
        """The block's size in the model tensor: its shape, after a size-1 expert dimension if the model
        tensor has one more."""
        return (1,) * (model_ndim - len(self.shape)) + self.shape

    def block(self, model_ndim: int) -> tuple[slice, ...]:
        """Its block of the model tensor, as an index."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.block_sizes(model_ndim)))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_shape(parts: list[StoredTensor]) -> tuple[int, ...]:
    """The shape of the model tensor that ``parts`` (from :func:`stored_tensors`) tile."""
    ndim = len(parts[0].offsets)
    return tuple(max(p.offsets[d] + p.block_sizes(ndim)[d] for p in parts) for d in range(ndim))


_LAYER = r"(?P<layer>model\.layers\.\d+)\."
# model_type -> (model tensor pattern, how its checkpoint names it): a rename (a string), or the expert
# projections fused along the model tensor's dim 1, in their order there (a tuple)
_FORMATS: dict[str, list[tuple[re.Pattern[str], str | tuple[str, ...]]]] = {
    "mixtral": [
        (re.compile(_LAYER + r"mlp\.gate\.weight"), "{layer}.block_sparse_moe.gate.weight"),
        (re.compile(_LAYER + r"mlp\.experts\.gate_up_proj"), ("{layer}.block_sparse_moe.experts.{expert}.w1.weight",
                                                             "{layer}.block_sparse_moe.experts.{expert}.w3.weight")),
        (re.compile(_LAYER + r"mlp\.experts\.down_proj"), ("{layer}.block_sparse_moe.experts.{expert}.w2.weight",)),
    ],
    # the router (mlp.gate), the shared expert and its gate keep their names
    "qwen2_moe": [
        (re.compile(_LAYER + r"mlp\.experts\.gate_up_proj"), ("{layer}.mlp.experts.{expert}.gate_proj.weight",
                                                             "{layer}.mlp.experts.{expert}.up_proj.weight")),
        (re.compile(_LAYER + r"mlp\.experts\.down_proj"), ("{layer}.mlp.experts.{expert}.down_proj.weight",)),
    ],
}
# the config key that counts a layer's experts
_EXPERT_COUNT_KEYS = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts"}


def expert_count_key(model_type: str) -> str | None:
    """The config key counting the experts of ``model_type``'s fused expert tensors (None: it has none)."""
    return _EXPERT_COUNT_KEYS.get(model_type)


def stored_tensors(model_type: str, name: str, shape: tuple[int, ...]) -> list[StoredTensor]:
    """How the Hugging Face checkpoint stores the model tensor ``name`` of ``shape`` (its in-memory name
    and shape in transformers' model): the tensor itself, renamed, or one block per expert and
    projection, in the model tensor's byte order."""
    shape = tuple(shape)
    for pattern, stored in _FORMATS.get(model_type, ()):
        match = pattern.fullmatch(name)
        if match is None:
            continue
        if isinstance(stored, str):
            return [StoredTensor(stored.format(**match.groupdict()), shape, (0,) * len(shape))]
        experts, rows, columns = shape
        part = rows // len(stored)  # transformers fuses projections of equal width
        return [StoredTensor(template.format(expert=expert, **match.groupdict()), (part, columns), (expert, i * part, 0))
                for expert in range(experts) for i, template in enumerate(stored)]
    return [StoredTensor(name, shape, (0,) * len(shape))]
