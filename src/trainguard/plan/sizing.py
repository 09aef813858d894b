"""How big a checkpoint is (reference 002's arithmetic, pure).

Mixed-precision Adam keeps bf16 weights (2 bytes per parameter), an fp32 master copy (4) and two fp32
moments (8): 14 bytes per parameter in a full checkpoint, 2 in a weights-only one. BLOOM-176B:
176e9 × 14 / 2**30 = 2294.77 GiB full, 327.82 GiB of bf16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
WEIGHT_BYTES = 2  # bf16
MASTER_BYTES = 4  # fp32 master weights
MOMENT_BYTES = 8  # Adam's two fp32 moments


def transformer_params(hidden: int, layers: int, seq_len: int, vocab: int) -> int:
    """A GPT/BLOOM-style model: ``12h² + 13h`` per block, plus ``v·h + s·h + 2h`` for embeddings and norms."""
    h = hidden
    return layers * (12 * h * h + 13 * h) + vocab * h + seq_len * h + 2 * h


@dataclass(frozen=True)
class CheckpointSizes:
    params: int
    weights_bytes: int  # a weights-only (bf16) checkpoint or export
    full_bytes: int  # weights + fp32 master + optimizer moments: what resume needs
    full_per_rank_bytes: int  # one rank's share: each model-parallel slice once, sharded over dp_shard
    local_tier_bytes: int  # the redundant per-rank tier: every rank writes its own slice, replicas included


def checkpoint_sizes(params: int, tp: int = 1, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1) -> CheckpointSizes:
    """Sizes for ``params`` parameters laid out over tp × pp model-parallel ranks, replicated over
    ``dp_replicate`` and sharded over ``dp_shard`` (ZeRO/FSDP)."""
    if min(params, tp, pp, dp_replicate, dp_shard) < 1:
        raise ValueError("params and every degree must be positive")
    full = params * (WEIGHT_BYTES + MASTER_BYTES + MOMENT_BYTES)
    per_rank = -(-full // (tp * pp * dp_shard))  # ceil: the largest slice a rank stages
    return CheckpointSizes(
        params=params,
        weights_bytes=params * WEIGHT_BYTES,
        full_bytes=full,
        full_per_rank_bytes=per_rank,
        local_tier_bytes=per_rank * tp * pp * dp_shard * dp_replicate,
    )


def retention_bytes(full_bytes: int, total_steps: int, save_interval: int, keep_last: int,
                    keep_every: int | None) -> int:
    """Storage the durable tier needs at the end of a run under keep_last / keep_every retention."""
    if save_interval < 1 or keep_last < 1:
        raise ValueError("save_interval and keep_last must be positive")
    saved = set(range(save_interval, total_steps + 1, save_interval))
    forever = {s for s in saved if keep_every and s % keep_every == 0}
    recent = sorted(saved - forever)[-keep_last:]
    return full_bytes * (len(forever) + len(recent))
