"""``trainguard plan``: reference 002's BLOOM-176B arithmetic, and the Young/Daly interval."""

from __future__ import annotations

import json
import math

import pytest

from trainguard.cli import main
from trainguard.plan import checkpoint_sizes, expected_goodput, optimal_save_interval, transformer_params
from trainguard.plan.sizing import GIB, retention_bytes


def _as_written(gib: float) -> float:
    """Reference 002 writes its results cut (not rounded) to two decimals."""
    return math.floor(gib * 100) / 100


def test_bloom_176b_checkpoint_sizes_match_reference_002():
    sizes = checkpoint_sizes(176 * 10**9, tp=4, pp=12, dp_shard=8)
    assert _as_written(sizes.weights_bytes / GIB) == 327.82  # "just the bf16 weights are 329GB"
    assert _as_written(sizes.full_bytes / GIB) == 2294.77  # "each checkpoint ... is 2.3TB"


def test_bloom_parameter_formula_matches_reference_002():
    params = transformer_params(hidden=14336, layers=70, seq_len=2048, vocab=250680)
    assert round(params * 2 / GIB, 2) == 328.34  # "total 328.34GB" in BF16
    block = 2 * (12 * 14336**2 + 13 * 14336)
    assert round(block / GIB, 2) == 4.59


def test_young_daly_interval_and_goodput():
    interval = optimal_save_interval(save_seconds=60, mtbf_seconds=24 * 3600)
    assert math.isclose(interval, math.sqrt(2 * 60 * 86400))
    best = expected_goodput(interval, 60, 86400)
    assert best > expected_goodput(interval / 4, 60, 86400) and best > expected_goodput(interval * 4, 60, 86400)
    with pytest.raises(ValueError):
        optimal_save_interval(0, 1)


def test_retention_storage_counts_kept_checkpoints():
    # saves at 100..1000; keep every 500 for ever (500, 1000) plus the last 3 others (700, 800, 900)
    assert retention_bytes(10, total_steps=1000, save_interval=100, keep_last=3, keep_every=500) == 50


def test_plan_command_prints_the_figures(capsys):
    code = main(["plan", "--params", "176e9", "--tp", "4", "--pp", "12", "--dp-shard", "8", "--save-seconds", "60",
                 "--mtbf-hours", "24", "--step-seconds", "100", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert code == 0 and _as_written(figures["full_gib"]) == 2294.77
    assert figures["optimal_interval_steps"] == round(math.sqrt(2 * 60 * 86400) / 100)
    assert main(["plan", "--hidden", "64"]) == 2
