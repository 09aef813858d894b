"""``trainguard guards calibrate`` on synthetic step events."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from trainguard.cli import guards as guards_cli
from trainguard.config.aliases import translate_reference_keys
from trainguard.errors import EXIT_USAGE, ConfigError, TrainguardError
from trainguard.events import EventLog
from trainguard.guards import calibrate, calibrate_run
from trainguard.guards.calibrate import (
    MIN_FINITE,
    Series,
    count_threshold_for,
    longest_streak_above,
    nice_ceil,
    step_series,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, norms, embedding=None, *, start: int = 1) -> Path:
    """A run directory whose events.jsonl holds one ``step`` event per norm, as the trainer writes them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = EventLog(run_dir / "events.jsonl")
    log.emit("run_started", step=0, resumed_from=None)
    for i, norm in enumerate(norms):
        fields = {"loss": 2.0, "global_norm": float(norm), "lr": 1e-3}
        if embedding is not None:
            fields["embedding_local_norm"] = float(embedding[i])
        log.emit("step", step=start + i, **fields)
    log.close()
    return run_dir


def lognormal(n: int, seed: int = 0, median: float = 2.0, sigma: float = 0.3) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(math.log(median), sigma, n)


def run_cli(*argv: str) -> int:
    """The sub-command through its own parser, as ``trainguard guards ...`` will be."""
    parser = argparse.ArgumentParser(prog="trainguard")
    guards_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["guards", *argv])
    try:
        return args.func(args)
    except TrainguardError as exc:
        return exc.exit_code


def test_recommendations_on_a_clean_lognormal_run(tmp_path: Path):
    norms, embedding = lognormal(2000, 1), lognormal(2000, 2, median=250.0, sigma=0.05)
    run = write_run(tmp_path / "run", norms, embedding)
    cal = calibrate_run(run)

    assert cal.global_norm_spike_threshold > norms.max()
    assert cal.global_norm_spike_threshold == nice_ceil(1.5 * norms.max())
    assert cal.global_norm_spike_threshold <= 1.5 * norms.max() * 1.01
    assert cal.embedding_local_norm_threshold > embedding.max()
    assert 10 <= cal.global_norm_spike_count_threshold <= 100
    stats = cal.stats["global_norm"]
    assert stats["count"] == 2000 and stats["non_finite"] == 0
    assert stats["p50"] == pytest.approx(np.percentile(norms, 50))
    assert stats["p50"] < stats["p90"] < stats["p99"] < stats["p99.9"] <= stats["max"] == pytest.approx(norms.max())
    assert stats["max_step"] == int(np.argmax(norms)) + 1

    saved = json.loads((run / "calibration.json").read_text())
    assert saved["recommendations"] == {
        "global_norm_spike_threshold": cal.global_norm_spike_threshold,
        "global_norm_spike_count_threshold": cal.global_norm_spike_count_threshold,
        "embedding_local_norm_threshold": cal.embedding_local_norm_threshold,
    }
    assert saved["trainguard_keys"]["guards.skip.threshold"] == cal.global_norm_spike_threshold
    png = (run / "calibration.png").read_bytes()
    assert len(png) > 10_000 and png.startswith(PNG_MAGIC)
    assert sorted(p.name for p in run.iterdir()) == ["calibration.json", "calibration.png", "events.jsonl"]


def test_yaml_snippet_uses_the_reference_keys_and_loads_as_aliases(tmp_path: Path):
    run = write_run(tmp_path / "run", lognormal(200), lognormal(200, 3, median=100.0))
    cal = calibrate_run(run)
    snippet = json.loads((run / "calibration.json").read_text())["yaml"]
    raw = yaml.safe_load(snippet)
    assert raw["use_skip_data_by_global_norm"] is True
    assert raw["monitor_config"]["global_norm_spike_threshold"] == cal.global_norm_spike_threshold
    assert raw["monitor_config"]["global_norm_spike_count_threshold"] == cal.global_norm_spike_count_threshold
    assert raw["callbacks"] == [
        {"type": "CheckpointMonitor", "embedding_local_norm_threshold": cal.embedding_local_norm_threshold}
    ]
    ours = translate_reference_keys(raw, "calibration")
    assert ours["guards"]["skip"] == {
        "enabled": True,
        "threshold": cal.global_norm_spike_threshold,
        "count_threshold": cal.global_norm_spike_count_threshold,
    }
    assert ours["guards"]["health"] == {"enabled": True, "embedding_threshold": cal.embedding_local_norm_threshold}


def test_without_embedding_norms_only_the_skip_keys_are_recommended(tmp_path: Path):
    run = write_run(tmp_path / "run", lognormal(100))
    cal = calibrate_run(run)
    assert cal.embedding_local_norm_threshold is None and cal.stats["embedding_local_norm"] is None
    assert any("no embedding_local_norm" in note for note in cal.notes)
    raw = yaml.safe_load(json.loads((run / "calibration.json").read_text())["yaml"])
    assert "callbacks" not in raw and "use_checkpoint_health_monitor" not in raw
    assert (run / "calibration.png").read_bytes().startswith(PNG_MAGIC)


def test_non_finite_values_are_counted_and_left_out(tmp_path: Path):
    norms = list(lognormal(50))
    norms[10], norms[20], norms[30] = math.nan, math.inf, 1e30
    run = write_run(tmp_path / "run", norms)
    cal = calibrate_run(run)
    stats = cal.stats["global_norm"]
    assert stats["non_finite"] == 2 and stats["count"] == 48 and stats["max"] == 1e30
    assert any("non-finite" in note for note in cal.notes)


def test_a_lone_outlier_is_pointed_out():
    norms = list(lognormal(2000))
    norms[1500] = 1e3
    cal = calibrate(step_series({"kind": "step", "step": i + 1, "global_norm": n} for i, n in enumerate(norms)))
    assert cal.global_norm_spike_threshold == 1500.0
    assert any("(1000 at step 1501) is more than 3x its p99.9" in note for note in cal.notes)


def test_a_redone_step_counts_once_with_its_last_value():
    events = [
        {"kind": "step", "step": 1, "global_norm": 100.0},
        {"kind": "step", "step": 2, "global_norm": 2.0},
        {"kind": "step", "step": 1, "global_norm": 1.0},
        {"kind": "step", "step": 3, "global_norm": "nan", "embedding_local_norm": 5.0},
        {"kind": "step", "step": 4, "global_norm": 50.0, "skipped": True},
        {"kind": "checkpoint_saved", "step": 2},
    ]
    series = step_series(events)
    assert series["global_norm"].steps == [1, 2, 3]
    assert series["global_norm"].values[:2] == [1.0, 2.0] and math.isnan(series["global_norm"].values[2])
    assert series["embedding_local_norm"].steps == [3]


def test_ignore_first_leaves_early_steps_out(tmp_path: Path):
    norms = np.concatenate([np.linspace(50.0, 3.0, 20), lognormal(200)])
    series = step_series({"kind": "step", "step": i + 1, "global_norm": float(n)} for i, n in enumerate(norms))
    loose = calibrate(series)
    tight = calibrate(series, ignore_first=20)
    assert loose.global_norm_spike_threshold == nice_ceil(75.0)
    assert any("early in the run" in note for note in loose.notes)
    assert tight.global_norm_spike_threshold == nice_ceil(1.5 * norms[20:].max())
    assert tight.stats["global_norm"]["count"] == 200


def test_count_threshold_grows_with_natural_streaks():
    base = list(lognormal(1000))
    assert longest_streak_above([1, 5, 5, 1, 5, 5, 5, 1], 2) == 3
    assert count_threshold_for(0) == 10 and count_threshold_for(7) == 14 and count_threshold_for(80) == 100
    bursty = base[:500] + [20.0] * 8 + base[500:]  # elevated norms that last 8 steps in healthy training
    cal = calibrate(step_series({"kind": "step", "step": i + 1, "global_norm": n} for i, n in enumerate(bursty)))
    assert cal.longest_elevated_streak == 8 and cal.global_norm_spike_count_threshold == 16


@pytest.mark.parametrize("x, expected", [(66.47, 66.5), (66.5, 66.5), (12345.0, 12400.0), (0.0123401, 0.0124),
                                         (3.0, 3.0), (999.9, 1000.0)])
def test_nice_ceil(x, expected):
    assert nice_ceil(x) == expected and nice_ceil(x) >= x


def test_out_directory_and_json_output(tmp_path: Path, capsys):
    run = write_run(tmp_path / "run", lognormal(64))
    out = tmp_path / "report" / "guards"
    assert run_cli("calibrate", str(run), "--out", str(out), "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "calibration.json").read_text())
    assert (out / "calibration.png").read_bytes().startswith(PNG_MAGIC)
    assert not (run / "calibration.json").exists()


def test_table_output(tmp_path: Path, capsys):
    run = write_run(tmp_path / "run", lognormal(64), lognormal(64, 5, median=300.0))
    assert run_cli("calibrate", str(run)) == 0
    out = capsys.readouterr()
    for word in ("global_norm", "embedding_local_norm", "p50", "p90", "p99", "p99.9", "max", "count",
                 "global_norm_spike_threshold:", "global_norm_spike_count_threshold:",
                 "embedding_local_norm_threshold:", "type: CheckpointMonitor"):
        assert word in out.out
    assert "wrote calibration.json and calibration.png" in out.err


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no such run directory"),
        (lambda d: d.mkdir(), "events.jsonl: no such file"),
        (lambda d: write_run(d, lognormal(MIN_FINITE - 1)), f"only {MIN_FINITE - 1} finite global_norm values"),
        (lambda d: write_run(d, [math.nan] * 40 + list(lognormal(5))), "only 5 finite global_norm values"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path: Path, setup, message):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(ConfigError, match=message) as info:
        calibrate_run(run)
    assert info.value.exit_code == EXIT_USAGE and "\n" not in str(info.value)
    assert run_cli("calibrate", str(run)) == EXIT_USAGE
    assert not (run / "calibration.json").exists()


def test_bad_options(tmp_path: Path):
    run = write_run(tmp_path / "run", lognormal(64))
    with pytest.raises(ConfigError, match="--margin"):
        calibrate_run(run, margin=0.5)
    with pytest.raises(ConfigError, match="--ignore-first"):
        calibrate_run(run, ignore_first=-1)
    with pytest.raises(ConfigError, match="after step 60"):
        calibrate_run(run, ignore_first=60)


def test_series_helper_finite():
    s = Series("global_norm", [1, 2, 3], [1.0, math.nan, 3.0])
    assert s.finite() == ([1, 3], [1.0, 3.0])
