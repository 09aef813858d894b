"""Checkpoint health: the embedding-norm rule and the reference's ``health_ckpts.json`` format."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from trainguard.fs.layout import HEALTH_FILE
from trainguard.errors import CheckpointError
from trainguard.guards import (
    NO_HEALTHY_CHECKPOINT_MESSAGE,
    HealthConfig,
    is_unhealthy,
    latest_healthy_step,
    read_health_records,
    record_health,
    save_health,
    unhealthy_names,
)


@pytest.fixture
def health_file(tmp_path: Path) -> Path:
    return tmp_path / HEALTH_FILE


def test_defaults_are_the_references():
    assert HealthConfig() == HealthConfig(enabled=False, embedding_threshold=1.0)


@pytest.mark.parametrize(
    "norm, threshold, unhealthy",
    [
        (251.79117, 270.0, False),
        (291.3603, 270.0, True),
        (270.0, 270.0, False),  # only a norm above the threshold is unhealthy
        (0.0, 1.0, False),
        (math.nan, 270.0, True),
        (math.inf, 270.0, True),
        (-math.inf, 270.0, True),
    ],
)
def test_is_unhealthy(norm, threshold, unhealthy):
    assert is_unhealthy(norm, threshold) is unhealthy


def test_file_format_is_the_references(health_file: Path):
    record_health(health_file, "global_step_1", unhealthy=False)
    record_health(health_file, "global_step_2", unhealthy=True)
    assert json.loads(health_file.read_text()) == [
        {"is_health": 0, "ckpt_name": "global_step_1"},
        {"is_health": 1, "ckpt_name": "global_step_2"},
    ]
    # Byte for byte as the reference shows it: 4-space indent, is_health before ckpt_name.
    assert health_file.read_text() == (
        "[\n"
        "    {\n"
        '        "is_health": 0,\n'
        '        "ckpt_name": "global_step_1"\n'
        "    },\n"
        "    {\n"
        '        "is_health": 1,\n'
        '        "ckpt_name": "global_step_2"\n'
        "    }\n"
        "]\n"
    )
    assert [list(r) for r in json.loads(health_file.read_text())] == [["is_health", "ckpt_name"]] * 2


def test_reads_the_references_own_example(health_file: Path):
    health_file.write_text(
        '[\n    {\n        "is_health": 0,\n        "ckpt_name": "llama3_1_8b_rank_0-1_1.safetensors"\n    },\n'
        '    {\n        "is_health": 1,\n        "ckpt_name": "llama3_1_8b_rank_0-2_1.safetensors"\n    }\n]'
    )
    assert read_health_records(health_file) == [
        {"is_health": 0, "ckpt_name": "llama3_1_8b_rank_0-1_1.safetensors"},
        {"is_health": 1, "ckpt_name": "llama3_1_8b_rank_0-2_1.safetensors"},
    ]
    assert unhealthy_names(health_file) == {"llama3_1_8b_rank_0-2_1.safetensors"}


def test_replacing_a_record_keeps_its_place(health_file: Path):
    for step, bad in ((4, False), (8, True), (12, False)):
        record_health(health_file, f"global_step_{step}", bad)
    record_health(health_file, "global_step_8", unhealthy=False)  # e.g. a step redone after a resume
    assert json.loads(health_file.read_text()) == [
        {"is_health": 0, "ckpt_name": "global_step_4"},
        {"is_health": 0, "ckpt_name": "global_step_8"},
        {"is_health": 0, "ckpt_name": "global_step_12"},
    ]
    record_health(health_file, "global_step_4", unhealthy=True)
    assert [r["is_health"] for r in read_health_records(health_file)] == [1, 0, 0]
    assert unhealthy_names(health_file) == {"global_step_4"}


def test_duplicates_collapse_into_the_first_place(health_file: Path):
    health_file.write_text(json.dumps([
        {"is_health": 1, "ckpt_name": "global_step_4"},
        {"is_health": 0, "ckpt_name": "global_step_8"},
        {"is_health": 0, "ckpt_name": "global_step_4"},
    ]))
    assert unhealthy_names(health_file) == set()  # the last record of a name wins
    record_health(health_file, "global_step_4", unhealthy=True)
    assert read_health_records(health_file) == [
        {"is_health": 1, "ckpt_name": "global_step_4"},
        {"is_health": 0, "ckpt_name": "global_step_8"},
    ]


def test_written_atomically_without_leftovers(health_file: Path):
    for step in range(1, 6):
        record_health(health_file, f"global_step_{step}", unhealthy=step % 2 == 0)
    assert sorted(p.name for p in health_file.parent.iterdir()) == [HEALTH_FILE]
    assert unhealthy_names(health_file) == {"global_step_2", "global_step_4"}


def test_a_failed_write_leaves_the_old_file(health_file: Path, monkeypatch):
    record_health(health_file, "global_step_1", unhealthy=False)
    before = health_file.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        record_health(health_file, "global_step_2", unhealthy=True)
    assert health_file.read_bytes() == before
    assert sorted(p.name for p in health_file.parent.iterdir()) == [HEALTH_FILE]


def test_missing_file_reads_as_no_records(health_file: Path):
    assert read_health_records(health_file) == []
    assert unhealthy_names(health_file) == set()


@pytest.mark.parametrize(
    "content",
    [
        "",
        "[{",
        '{"is_health": 0, "ckpt_name": "global_step_1"}',
        '[{"is_health": 2, "ckpt_name": "global_step_1"}]',
        '[{"is_health": true, "ckpt_name": "global_step_1"}]',
        '[{"is_health": "0", "ckpt_name": "global_step_1"}]',
        '[{"is_health": 0}]',
        '[{"is_health": 0, "ckpt_name": 8}]',
        '["global_step_1"]',
    ],
)
def test_malformed_file_is_a_checkpoint_error_naming_it(health_file: Path, content: str):
    health_file.write_text(content)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(health_file))}: malformed health record file"):
        read_health_records(health_file)
    with pytest.raises(CheckpointError, match=re.escape(str(health_file))):
        record_health(health_file, "global_step_2", unhealthy=False)
    assert health_file.read_text() == content  # never overwritten by a guess


def test_latest_healthy_step_excludes_unhealthy_checkpoints(health_file: Path):
    for step, bad in ((4, False), (8, False), (12, True), (16, True)):
        record_health(health_file, f"global_step_{step}", bad)
    bad = unhealthy_names(health_file)
    assert latest_healthy_step([4, 8, 12, 16], bad) == 8
    assert latest_healthy_step([4, 8, 12, 16, 20], bad) == 20  # no record yet: not known to be unhealthy
    assert latest_healthy_step([12, 16], bad) is None
    assert latest_healthy_step([], bad) is None


def test_no_healthy_checkpoint_message_says_what_to_do():
    assert "no healthy checkpoint" in NO_HEALTHY_CHECKPOINT_MESSAGE
    assert "embedding_local_norm_threshold" in NO_HEALTHY_CHECKPOINT_MESSAGE
    assert "Train" in NO_HEALTHY_CHECKPOINT_MESSAGE


@pytest.mark.parametrize("config, norm, record", [
    (HealthConfig(enabled=False), 3.0, None),  # not monitored
    (HealthConfig(enabled=True, embedding_threshold=5.0), None, None),  # nothing measured since a resume
    (HealthConfig(enabled=True, embedding_threshold=5.0), 5.0,
     {"is_health": 0, "embedding_local_norm": 5.0, "threshold": 5.0}),
    (HealthConfig(enabled=True, embedding_threshold=5.0), 5.5,
     {"is_health": 1, "embedding_local_norm": 5.5, "threshold": 5.0}),
])
def test_a_saves_health_is_the_verdict_on_the_saved_steps_norm(config, norm, record):
    """``save_health``: what both step engines record with a save (the closure mode's max over ranks, live
    mode's norm of the summed gradient)."""
    assert save_health(config, norm) == record


def test_a_nan_norm_makes_an_unhealthy_save():
    record = save_health(HealthConfig(enabled=True, embedding_threshold=5.0), math.nan)
    assert record["is_health"] == 1 and math.isnan(record["embedding_local_norm"])
