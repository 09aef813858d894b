"""``trainguard report`` and ``trainguard status`` on a real faulty run, rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers.runs import events, ok, train, trainguard
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.guards.health import marked_unhealthy
from trainguard.report.facts import read_run

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

STEPS = 20
SPIKE_STEP, KILL_STEP, FLIP_STEP = 6, 11, 17
FAULTS = (f"spike:step={SPIKE_STEP};kill:rank=1,step={KILL_STEP};"
          f"bitflip:rank=1,step={FLIP_STEP},site=model.layers.1.input_layernorm,where=grad_input,bit=exp")
GUARDS = ["--save-interval", "4", "--set", "guards.skip.enabled=true", "--set", "guards.skip.threshold=8.0",
          "--set", "guards.health.enabled=true", "--set", "guards.health.embedding_threshold=1.9",
          "--set", "guards.sdc.enabled_level=2"]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory) -> Path:
    """A 2-rank run with a skipped spike, a killed rank (then resumed) and a transient bit flip."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    first = train(run_dir, 2, STEPS, *GUARDS, faults=FAULTS)
    assert first.returncode != 0, "the kill fault should have stopped the first attempt"
    # The fault ledger keeps fired faults from firing again: the second attempt finishes the run.
    ok(train(run_dir, 2, STEPS, *GUARDS, faults=FAULTS))
    return run_dir


@pytest.fixture(scope="module")
def reported(faulty_run) -> subprocess.CompletedProcess:
    """``trainguard report`` on the faulty run, once: its page and its TensorBoard scalars are read apart."""
    return ok(trainguard("report", str(faulty_run)))


def test_facts_of_a_faulty_run(faulty_run):
    facts = read_run(faulty_run)
    assert facts.state == "finished"
    assert facts.last_step.step == STEPS
    assert [s.step for s in facts.skips] == [SPIKE_STEP]
    assert facts.skips[0].threshold == 8.0 and facts.skip_threshold == 8.0
    # the spike is injected into the parameter gradients, where the SDC points see it too
    assert {d.step for d in facts.detections} == {SPIKE_STEP, FLIP_STEP}
    assert {d.verdict for d in facts.detections if d.step == FLIP_STEP} == {"transient"}
    assert len(facts.attempts) == 2 and facts.restarts == 1
    (incident,) = facts.incidents
    assert incident.cause == f"injected kill on rank 1 at step {KILL_STEP}"
    assert incident.last_step == KILL_STEP - 1
    assert incident.resumed_step == facts.attempts[1].resumed_step < KILL_STEP
    assert 0 < incident.back_to_training_s <= incident.recovered_s
    # Every checkpoint on disk is in the summary, with the health its manifest records.
    on_disk = {info.step: info for info in list_checkpoints(faulty_run / "checkpoints") if info.committed}
    present = {c.step: c for c in facts.checkpoints if c.present}
    assert present.keys() == on_disk.keys()
    for step, info in on_disk.items():
        assert present[step].health == ("unhealthy" if marked_unhealthy(info.manifest.health) else "healthy")
    deleted = [c for c in facts.checkpoints if c.deleted]
    assert len(deleted) == len(events(faulty_run, "checkpoint_deleted"))
    assert {c.health for c in facts.checkpoints} == {"healthy", "unhealthy"}


def _chromium(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: install Debian's chromium package (scripts/bootstrap.sh does)"
    profile = tmp_path / "chromium-profile"
    return subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)


def test_report_renders_in_headless_chromium(faulty_run, reported, tmp_path):
    proc = reported
    page_path = faulty_run / "report.html"
    assert f"report: {page_path}" in proc.stdout
    page = page_path.read_text()
    # Self-contained: every image is inline, nothing is fetched.
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)
    assert images == ["Loss", "Gradient norm", "Timeline"]
    for fact in ("injected kill on rank 1 at step 11", "model.layers.1.input_layernorm", "unhealthy", "transient"):
        assert fact in page

    dom = _chromium("--virtual-time-budget=5000", "--dump-dom", page_path.as_uri(), tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # Set by the page's script once loaded: how many <img> decoded (naturalWidth > 0) out of all.
    assert 'data-images-ready="3/3"' in dom.stdout, dom.stdout[:500]

    shot = tmp_path / "report.png"
    proc = _chromium("--window-size=1200,2400", f"--screenshot={shot}", page_path.as_uri(), tmp_path=tmp_path)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    # Not blank: the plots put many coloured (non-grey) pixels on the page.
    coloured = (pixels.max(axis=-1) - pixels.min(axis=-1)) > 0.3
    assert coloured.sum() > 2000, f"only {coloured.sum()} coloured pixels: the plots did not render"


def test_tensorboard_scalars(faulty_run, reported):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(faulty_run / "tensorboard"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"train/loss", "train/global_norm", "guards/skipped", "sdc/detections"} <= set(tags)
    losses = {e.step: e.value for e in accumulator.Scalars("train/loss")}
    logged = {e["step"]: e["loss"] for e in events(faulty_run, "step")}  # a redone step: its last value
    assert losses.keys() == logged.keys()
    assert all(abs(losses[s] - logged[s]) < 1e-5 for s in logged)
    assert [e.step for e in accumulator.Scalars("guards/skipped")] == [SPIKE_STEP]
    assert [e.step for e in accumulator.Scalars("sdc/detections")] == [SPIKE_STEP, FLIP_STEP]


def test_status_one_screen(faulty_run):
    out = ok(trainguard("status", str(faulty_run))).stdout
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.strip()}
    assert re.search(rf"\bstep\s+{STEPS}\b", lines["step"])
    assert "finished" in lines["state"]
    assert re.search(rf"skipped steps\s+1 at steps {SPIKE_STEP}\b", lines["skipped steps"])
    assert f"at steps {SPIKE_STEP}, {FLIP_STEP}" in lines["SDC detections"]
    assert re.search(r"restarts\s+1\b", lines["restarts"])
    assert re.search(rf"last checkpoint\s+step {STEPS} \(durable, (healthy|unhealthy)\)", lines["last checkpoint"])


def test_status_of_a_missing_run_dir(tmp_path):
    proc = trainguard("status", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"trainguard: error: {tmp_path / 'nope'}: no such run directory"]
    proc = trainguard("report", str(tmp_path))
    assert proc.returncode == 2
    assert "not a run directory" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _write_events(path: Path, items: list[dict]) -> None:
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
        f.write('{"time": 1, "kind": "step", "st')  # a torn last line, as a crash leaves


def test_later_event_kinds_and_heartbeats(tmp_path):
    """Restarts, exclusions, local and mirror tiers, heartbeats: shown; unknown kinds ignored."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = time.time()
    t = now - 60
    _write_events(run_dir / "events.jsonl", [
        {"time": t, "kind": "run_started", "step": 0, "rank": 0, "resumed_from": None},
        {"time": t + 1, "kind": "step", "step": 1, "rank": 0, "loss": 5.0, "global_norm": "nan", "skipped": True},
        {"time": t + 1.1, "kind": "data_skip", "step": 1, "rank": 0, "global_norm": "nan", "threshold": "inf", "nan": True},
        {"time": t + 2, "kind": "step", "step": 2, "rank": 0, "loss": 4.9, "global_norm": 2.0, "skipped": False},
        {"time": t + 3, "kind": "local_checkpoint_saved", "step": 2, "rank": 0, "seconds": 0.1},
        {"time": t + 4, "kind": "brand_new_kind", "step": "x", "rank": "y", "whatever": [1]},
        {"time": t + 5, "kind": "hang_detected", "step": 3, "rank": 1, "node": "node-b", "seconds": 30},
        {"ts": t + 6, "kind": "node_excluded", "node": "node-b", "reason": "hang", "rank": 1},
        {"time": t + 7, "kind": "restart", "incarnation": 1, "reason": "hang", "recover_seconds": 4.5},
        {"time": t + 8, "kind": "run_started", "step": 2, "rank": 0, "resumed_from": "local"},
        {"time": t + 8.5, "kind": "local_recovery", "step": 2, "rank": 0, "seconds": 0.3},
        {"time": t + 9, "kind": "step", "step": 3, "rank": 0, "loss": 4.8, "global_norm": 1.9, "skipped": False},
        {"time": t + 10, "kind": "mirror_uploaded", "step": 2, "rank": 0, "seconds": 2.0},
    ])
    beats = run_dir / "heartbeats"
    beats.mkdir()
    (beats / "rank_0.json").write_text(json.dumps({"step": 3, "time": now - 5, "phase": "forward"}))
    (beats / "rank_1.json").write_text('{"step": 3, "ti')  # torn mid-rewrite

    facts = read_run(run_dir, now=now)
    assert facts.state == "live"
    assert facts.excluded_nodes == ["node-b"]
    assert facts.restarts == 1
    assert [a.kind for a in facts.actions] == ["hang_detected", "node_excluded", "restart", "local_recovery",
                                               "mirror_uploaded"]
    assert facts.actions[2].seconds == 4.5
    assert {c.tier for c in facts.checkpoints} == {"local", "mirror"}
    (incident,) = facts.incidents
    assert incident.cause == "hang detected on rank 1 at step 3"
    assert incident.resumed_step == 2
    assert facts.skips[0].nan and facts.skips[0].threshold == float("inf")
    assert [h.rank for h in facts.heartbeats] == [0]
    assert any("rank_1.json" in note for note in facts.notes)

    out = ok(trainguard("status", str(run_dir))).stdout
    assert re.search(r"excluded nodes\s+node-b", out)
    assert re.search(r"last heartbeat\s+\d+ s ago", out)
    assert re.search(r"state\s+live", out)
    ok(trainguard("report", str(run_dir), "--no-tensorboard"))
    page = (run_dir / "report.html").read_text()
    assert "node_excluded" in page and "local_recovery" in page and "brand_new_kind" not in page


def test_each_sdc_row_shows_its_own_ranks_rerun_verdict(tmp_path):
    """Issue 38 item 11: the step's strongest verdict ("faulty", rank 1's) was shown on rank 0's rows too;
    a run without per-rank verdicts (older events) keeps the step's verdict on every row."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t = time.time() - 60
    detection = {"kind": "sdc_detected", "point": "transformer.h.0.ln_1", "level": 1, "value": 1e30, "rule": "v1"}
    _write_events(run_dir / "events.jsonl", [
        {"time": t, "kind": "run_started", "step": 0, "rank": 0, "resumed_from": None},
        {"time": t + 1, "step": 5, "rank": 0, **detection},
        {"time": t + 1, "step": 5, "rank": 1, **detection},
        {"time": t + 2, "kind": "sdc_rerun", "step": 5, "rank": 0, "verdict": "faulty", "reran": True, "ranks": [0, 1],
         "verdicts": {"0": "reproducible", "1": "faulty"}},
        {"time": t + 3, "step": 6, "rank": 0, **detection},
        {"time": t + 4, "kind": "sdc_rerun", "step": 6, "rank": 0, "verdict": "transient", "ranks": [0]},
    ])
    facts = read_run(run_dir)
    assert [(d.step, d.rank, d.verdict) for d in facts.detections] == [
        (5, 0, "reproducible"), (5, 1, "faulty"), (6, 0, "transient")]
