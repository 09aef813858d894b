"""SDC detection with its rerun on live mode's FSDP2 path (issue 35; ``live/sdc.py``, docs/sdc.md):
tests/integration/live_fsdp_loop.py's MLP sharded with ``fully_shard`` over the replica group's mesh, 2
replica groups x 2 ranks, 8 micro-batches, dropout, AdamW; ``guards.sdc.enabled_level: 2`` with
``strikes: 2`` and one module point, ``guards.sdc.points: ["4"]`` (the Tanh after the second Linear,
checked on the gradient flowing into it), besides one point per parameter shard (``grad:NAME (shard S)``);
durable checkpoints every 4 steps, replica fingerprints every 2 (``helpers/live_fsdp.py``'s ``CLEAN``).

Four runs: SDC off (the session's fault-free run, ``live_fsdp_clean``, which test_live_fsdp.py compares
with too; it differs from the next by ``guards.sdc`` alone), and three started together: SDC on (no fault),
rank 1's point scaled x1e9 once at step 3
and once at step 5 (the drill's transient ``scale``: caught at level 1, the rerun clean, a strike each
time; the second reaches ``strikes``, so rank 1 writes its ``faulty_ranks.json`` entry and exits 17, its
group leaves the quorum and is started again, and rejoins), and rank 2's point scaled at every step from
the last one (``persistent=1``: the rerun reproduces it, the step is skipped).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.live_fsdp import CLEAN, STEPS, WORLD, StartedRun, start_live_fsdp
from helpers.runs import events as events_of
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.events.log import read_events
from trainguard.fs.layout import extra_state_name
from trainguard.guards.sdc import faulty_ranks_path
from trainguard.live.compare import bitwise_differences
from trainguard.live.files import events_path, final_path
from trainguard.live.rank import GROUP_OUT_EXIT

SDC = CLEAN.replace("guards: {fingerprint: {interval: 2}}",
                    'guards: {fingerprint: {interval: 2}, sdc: {enabled_level: 2, strikes: 2, points: ["4"]}}')
# the drill's module fault (docs/faults.md): the gradient into module "4" of the first micro-batch RANK computes at STEP
SCALE = "scale:rank={rank},step={step},site=4,where=grad_input,factor=1e9"
# (rank, step), once each: rank 1 twice, struck out at the second
TRANSIENT = ((1, 3), (1, 5))
STRUCK_OUT_AT = 5
REPRODUCIBLE_AT = STEPS  # rank 2, persistent from the last step


@pytest.fixture(scope="module")
def runs(tmp_path_factory, live_fsdp_clean) -> dict[str, Path]:
    """The three runs with SDC on, started together beside the session's fault-free run (SDC off)."""
    root = tmp_path_factory.mktemp("live_fsdp_sdc")
    config = root / "live_fsdp_sdc.yaml"
    config.write_text(SDC, encoding="utf-8")
    struck = "; ".join(SCALE.format(rank=rank, step=step) for rank, step in TRANSIENT)
    started = [StartedRun(root / name, start_live_fsdp(config, root / name, *overrides), f"the live FSDP2 run {name}")
               for name, overrides in (("clean", ()), ("struck", (f"faults={struck}",)), (
                   "reproducible", (f"faults={SCALE.format(rank=2, step=REPRODUCIBLE_AT)},persistent=1",)))]
    return {"off": live_fsdp_clean.finished(), **{run.run_dir.name: run.finished() for run in started}}


def _trained(run_dir: Path, rank: int) -> dict:
    state = safe_torch_load(final_path(run_dir, rank))
    return {key: state[key] for key in ("model", "optimizer")}


def test_sdc_on_without_a_fault_detects_nothing_and_ends_bitwise_as_the_run_with_sdc_off(runs):
    [points] = events_of(runs["clean"], "sdc_points")
    assert points["names"][0] == "4" and "grad:3.weight (shard 1)" in points["names"]
    assert not [e for e in read_events(events_path(runs["clean"])) if e["kind"].startswith("sdc_")
                and e["kind"] != "sdc_points"]
    for rank in range(WORLD):
        assert bitwise_differences(_trained(runs["clean"], rank), _trained(runs["off"], rank)) == [], rank


def test_a_transient_fault_is_found_at_level_1_and_the_clean_rerun_is_used_with_a_strike(runs):
    run_dir = runs["struck"]
    detected = events_of(run_dir, "sdc_detected")
    assert {e["step"] for e in detected} == {step for _, step in TRANSIENT}
    # the module point: its value computed by the faulted rank alone; the parameter-gradient points of every
    # shard too
    assert [(e["step"], e["computed_by"], e["level"]) for e in detected if e["point"] == "4"] == \
        [(step, [rank], 1) for rank, step in TRANSIENT]
    assert {e["point"] for e in detected} >= {"grad:3.weight (shard 0)", "grad:3.weight (shard 1)"}
    reruns = [(e["step"], e["verdict"], e["ranks"]) for e in events_of(run_dir, "sdc_rerun")]
    assert reruns == [(3, "transient", [1]), (5, "faulty", [1])]
    attributions = [(e["step"], e["rank"], e["attribution"], e["strikes"], e["faulty"], e["rerun_abnormal"])
                    for e in events_of(run_dir, "sdc_attribution")]
    assert attributions == [(3, 1, "transient", 1, False, []), (5, 1, "transient", 2, True, [])]
    # the rerun's sum used: no step skipped, and every rank's parameters and optimizer state are the
    # fault-free run's, bitwise
    assert not [e for e in events_of(run_dir, "live_step") if e["skipped"]]
    for rank in range(WORLD):
        assert bitwise_differences(_trained(run_dir, rank), _trained(runs["clean"], rank)) == [], rank


def test_the_detectors_state_and_strikes_travel_in_the_durable_checkpoints(runs):
    def guards(run: str, step: int, rank: int) -> dict:
        checkpoint = runs[run] / "checkpoints" / f"global_step_{step}"
        return safe_torch_load(checkpoint / extra_state_name(WORLD, rank))["stateful"]["live_guards"]

    def strikes(book: dict) -> list[tuple[int, list[int]]]:
        return [(entry["rank"], [strike["step"] for strike in entry["strikes"]]) for entry in book["devices"]]

    detections = len(events_of(runs["struck"], "sdc_detected"))
    last_step = runs["struck"] / "checkpoints" / f"global_step_{STEPS}"
    # step 8 is saved by the quorum's members then: with group 0 (restarted after rank 1's exit) only if it
    # rejoined before that boundary, which is a matter of timing; the files are named by the saving quorum's size
    saved = sorted(last_step.glob("extra_state_world_size_*_rank_*.pt"))
    rejoined = len(saved) == WORLD
    assert len(saved) in (2, WORLD), saved
    # rank 1's exit at step 5 is planned: step 4's async save commits on every member first, never abandoned
    assert not events_of(runs["struck"], "live_save_abandoned")
    for rank in range(WORLD):
        # step 4: rank 1's first strike in every rank's copy
        assert strikes(guards("struck", 4, rank)["sdc_strikes"]) == [(1, [3])], rank
    clean = guards("clean", STEPS, 0)
    assert strikes(clean["sdc_strikes"]) == []
    for path in saved:
        # step 8: rank 1's strikes dropped when its replacement joined (still held if it joins later), and the
        # detectors' state the fault-free run's but for the detections counted
        last = safe_torch_load(path)["stateful"]["live_guards"]
        assert strikes(last["sdc_strikes"]) == ([] if rejoined else [(1, [3, 5])]), path.name
        assert bitwise_differences(last["sdc_detector"], clean["sdc_detector"]) == \
            [f"/detections_total: {detections} != 0"], path.name
    # in the final state, after the join: every rank's alike, rank 1's strikes dropped
    final = [safe_torch_load(final_path(runs["struck"], rank))["guards"] for rank in range(WORLD)]
    assert all(bitwise_differences(final[0], other) == [] for other in final[1:])
    assert strikes(final[0]["sdc_strikes"]) == []
    if rejoined:
        assert bitwise_differences(final[0], safe_torch_load(saved[0])["stateful"]["live_guards"]) == []


def test_a_rank_reaching_its_strikes_exits_17_with_its_entry_and_its_group_is_replaced(runs):
    run_dir = runs["struck"]
    # rank 1 leaves at step 5's boundary; its group's other rank ends too (its FSDP2 mesh goes with it)
    assert sorted((e["target"], e["code"]) for e in events_of(run_dir, "live_exit")) == [(0, GROUP_OUT_EXIT), (1, 17)]
    [entry] = json.loads(faulty_ranks_path(run_dir).read_text())
    assert (entry["rank"], entry["local_device"], [s["step"] for s in entry["strikes"]]) == (1, "cpu:1", [3, 5])
    assert {e["rank"] for e in events_of(run_dir, "live_joined")} == {0, 1}
    degraded = {e["step"] for e in events_of(run_dir, "live_step") if e["members"] == 2}
    # live_step 5 is step 6: group 1 computed both groups' shares, judged with group 0's values from rank 2
    # and 3 (the end state is still the fault-free run's)
    assert degraded and min(degraded) == STRUCK_OUT_AT


def test_a_reproducible_fault_skips_the_step_with_a_strike_against_its_rank(runs):
    run_dir = runs["reproducible"]
    [rerun] = events_of(run_dir, "sdc_rerun")
    assert (rerun["step"], rerun["verdict"], rerun["ranks"]) == (REPRODUCIBLE_AT, "reproducible", [2])
    [attribution] = events_of(run_dir, "sdc_attribution")
    assert (attribution["rank"], attribution["attribution"], attribution["strikes"]) == (2, "reproducible", 1)
    skipped = {(e["step"], e["rank"]) for e in events_of(run_dir, "live_step") if e["skipped"]}
    assert skipped == {(REPRODUCIBLE_AT - 1, rank) for rank in range(WORLD)}  # live_step counts from 0
    assert not events_of(run_dir, "live_exit")
