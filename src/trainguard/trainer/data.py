"""Deterministic data pipeline of the reference trainer.

The order of samples is a pure function of (seed, global position), and the sampler's whole state is
that position (`consumed_samples`). That is what makes resume exact and lets a run continue on a
different number of data-parallel ranks: the global order does not depend on the topology, only the
way one global batch is split among ranks does.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Sequence
from importlib import resources
from typing import Any

import numpy as np
import torch

from trainguard.checkpoint.rollback import SkippedPositions
from trainguard.trainer.tokenizer import ByteTokenizer

CORPUS_RESOURCE = ("trainer", "corpus", "corpus.txt.gz")


@functools.cache
def load_corpus_tokens() -> torch.Tensor:
    """All tokens of the shipped corpus as int64 1-D: each document's bytes followed by eos.

    Cached per process; callers must not modify the returned tensor in place.
    """
    raw = resources.files("trainguard").joinpath(*CORPUS_RESOURCE).read_bytes()
    text = gzip.decompress(raw)
    eos = np.array([ByteTokenizer.eos_id], dtype=np.int64)
    parts: list[np.ndarray] = []
    # Documents are separated by one blank line in the file (see tools/make_corpus.py).
    for doc in text.strip(b"\n").split(b"\n\n"):
        parts.append(np.frombuffer(doc, dtype=np.uint8).astype(np.int64))
        parts.append(eos)
    return torch.from_numpy(np.concatenate(parts))


class TokenDataset:
    """Non-overlapping windows of `seq_len + 1` tokens: `seq_len` inputs plus one more for the shifted labels.

    Consecutive samples share one boundary token (sample i ends where sample i + 1 starts).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        start = i * self.seq_len
        # clone: a view would let a caller's in-place edit corrupt the cached corpus.
        return self.tokens[start : start + self.seq_len + 1].clone()


def make_batch(dataset: TokenDataset, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into `(input_ids, labels)`, both LongTensor [len(indices), seq_len].

    Labels are already shifted (`labels[:, t]` is the target for `input_ids[:, t]`), so compute the loss
    directly from the logits; do not pass them as `labels=` to a Hugging Face model, which shifts again.
    """
    if len(indices) == 0:
        raise ValueError("make_batch needs at least one index")
    samples = torch.stack([dataset[int(i)] for i in indices])
    return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()


class StatefulSampler(SkippedPositions):
    """Deterministic, rank-sharded, resumable order of sample indices.

    Global order: epoch e is `torch.randperm(dataset_len, generator=Generator().manual_seed(seed + e))`,
    epochs chained forever, so global position p is sample `perm_{p // n}[p % n]`. Each call to
    `next_batch_indices` consumes one global batch of `dp_size * micro_batch_size` positions; rank r gets
    the contiguous slice `[r * mbs, (r + 1) * mbs)` of it. With gradient accumulation, call it once per
    micro-batch. A global batch may straddle an epoch boundary.

    The state is just `consumed_samples` (a global position), the seed and the skipped ranges, so a
    state saved with one dp_size can be loaded into samplers with another: the union over ranks
    continues the same global order with nothing repeated or skipped.

    Skipped ranges (rollback mode) are half-open ranges of global positions that are never yielded: a
    global batch is the next `global_batch_size` positions that are not skipped, so every layout still
    sees the same global sequence, only split differently.
    """

    def __init__(self, dataset_len: int, dp_rank: int, dp_size: int, micro_batch_size: int, seed: int) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.dataset_len = dataset_len
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch_size = micro_batch_size
        self.seed = int(seed)
        super().__init__()
        # Only the current epoch's permutation is kept (plus the previous one while a global batch
        # straddles the boundary): randperm of a large dataset is the only costly step.
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch_size(self) -> int:
        return self.dp_size * self.micro_batch_size

    def _perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.dataset_len, generator=gen)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return perm

    def peek_global_indices(self, start: int, count: int) -> list[int]:
        """Sample indices at global positions [start, start + count), without changing state."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start} count={count}")
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.dataset_len)
            take = min(end - pos, self.dataset_len - offset)
            out.extend(self._perm(epoch)[offset : offset + take].tolist())
            pos += take
        return out

    def next_batch_indices(self) -> list[int]:
        """This rank's micro-batch of sample indices; advances the global position by one global batch."""
        ranges, self.consumed_samples = self.take(self.consumed_samples, self.global_batch_size)
        positions = [p for start, end in ranges for p in range(start, end)]
        mine = positions[self.dp_rank * self.micro_batch_size : (self.dp_rank + 1) * self.micro_batch_size]
        # mine is contiguous except where it straddles a skipped range
        indices: list[int] = []
        run_start = previous = mine[0]
        for position in [*mine[1:], None]:
            if position is None or position != previous + 1:
                indices.extend(self.peek_global_indices(run_start, previous + 1 - run_start))
                run_start = position
            previous = position
        return indices

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.dataset_len

    def state_dict(self) -> dict[str, Any]:
        # Plain ints and lists only, so the state loads with torch.load(weights_only=True).
        return {"consumed_samples": int(self.consumed_samples), "seed": int(self.seed),
                "skipped": [[int(a), int(b)] for a, b in self.skipped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("consumed_samples", "seed"):
            if key not in state:
                raise KeyError(f"sampler state is missing {key!r}")
            if isinstance(state[key], bool) or not isinstance(state[key], int):
                raise TypeError(f"sampler state {key!r} must be an int, got {type(state[key]).__name__}")
        if state["consumed_samples"] < 0:
            raise ValueError(f"sampler state consumed_samples must be >= 0, got {state['consumed_samples']}")
        skipped = state.get("skipped", [])  # absent in states saved before rollback mode existed
        if not isinstance(skipped, list) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and all(type(v) is int for v in r) and 0 <= r[0] < r[1]
            for r in skipped
        ):
            raise ValueError(f"sampler state 'skipped' must be a list of [start, end) position pairs, got {skipped!r}")
        self.consumed_samples = state["consumed_samples"]
        self.skipped = []
        for start, end in skipped:
            self.skip(start, end)
        if state["seed"] != self.seed:
            self._perms = {}
        # The saved seed wins: resuming continues the saved run's order.
        self.seed = state["seed"]
