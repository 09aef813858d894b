"""Live recovery (issue 23): 4 gloo ranks in 2 replica groups x 2, one SIGKILLed mid-run; the others
keep their processes, the replacement rejoins, and the end state is bitwise the fault-free run's.
The runs are the ones ``trainguard demo --live`` makes; every claim is checked here again from files."""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch

from helpers.live_attack import LiveAttack
from helpers.runs import events as events_of, trainguard, worker_env
from trainguard.demo.live import FAILING
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.checkpoint.staging import serialised
from trainguard.live.compare import bitwise_differences, replica_differences, run_differences, whole_final_state
from trainguard.live.files import final_path
from trainguard.live.launcher import LiveResult, LiveRun, launch, start_live_rank_server
from trainguard.live.samples import sample_problems
from trainguard.live.workload import Workload
from trainguard.report import read_run

STEPS, WORLD, GROUP, KILLED = FAILING.steps, FAILING.world, FAILING.group_size, 3
PARTIAL_CUTS = {"absent": (3, False, [0, 1]), "cut": (1, True, [2, 3])}  # stalled rank, cut, survivors
PARTIAL_CUT_TEST = "test_a_partial_cut_is_found_within_the_stall_bound_and_its_group_excluded"
DRILL_RUNS: dict[str, LiveRun] = {  # the run of each test below that makes its own (its item's name: the key)
    # hang_s below the stall bound (5 s): the ranks stopped before their all-reduce are a stall too, and
    # the first verdict ends the epoch (with both at 5 s, either could); this test is the heartbeat's
    "test_a_node_cut_off_is_found_silent_fenced_and_replaced_bitwise":
        dataclasses.replace(FAILING, kill_ranks=(0, 1), fault="stop", hang_s=3.0, spares=0),  # cold replacements
    "test_a_rank_that_dies_while_its_group_is_out_does_not_abort_the_groups_rejoin":
        dataclasses.replace(FAILING, spares=2, kill_during_shrink=2),
    "test_a_hung_rank_costs_the_survivors_the_stall_bound_not_the_heartbeat_timeout":
        dataclasses.replace(FAILING, fault="stop", spares=0, micro_batch_s=0.05),
    "test_a_transient_failure_is_undone_and_redone_bitwise_on_another_layout":
        dataclasses.replace(FAILING, groups=2, group_size=1, kill_ranks=(), spares=0, transient=(0, 20)),
    "test_a_second_failure_during_the_join_sends_the_group_out_again_and_it_rejoins_bitwise":
        dataclasses.replace(FAILING, spares=2, kill_joiner=True),
    "test_a_death_while_the_shrunk_epochs_group_is_built_is_recovered_not_escaped":
        dataclasses.replace(FAILING, groups=3, group_size=1, kill_ranks=(2,), spares=0, kill_during_shrink=1),
    **{f"{PARTIAL_CUT_TEST}[{name}]": dataclasses.replace(
        FAILING, kill_ranks=(), spares=0, stall_collective=(stalled, 10), stall_cut=cut, collective_timeout_s=120.0)
       for name, (stalled, cut, _) in PARTIAL_CUTS.items()},
}
# Runs launched at a time (and the demo's two beside the first ones): a run mostly waits (the simulated
# compute's sleeps, hang_s, the stall bound, replacements starting), about a fifth of a core each
CONCURRENT = 2


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict[str, Future]:
    """The runs of this module's selected tests (``DRILL_RUNS``), submitted at once and launched CONCURRENT
    at a time in threads of this process; each test waits for its own (``launched_run``)."""
    root = tmp_path_factory.mktemp("live_drills")
    selected = [item.name for item in request.session.items
                if item.module is request.module and item.name in DRILL_RUNS]
    start_live_rank_server()  # from this thread, while it may be the process's only one: the ranks are forked
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        yield {name: pool.submit(lambda name: (root / name, launch(root / name, DRILL_RUNS[name])), name)
               for name in selected}


def launched_run(launched: dict[str, Future], request) -> tuple[LiveRun, Path, LiveResult]:
    """The calling test's run: its ``LiveRun``, its directory and its result."""
    run_dir, result = launched[request.node.name].result()
    return DRILL_RUNS[request.node.name], run_dir, result


@pytest.fixture(scope="module")
def drill(launched, tmp_path_factory):
    """``trainguard demo --live``'s fault-free and failing runs, while the first of ``launched`` run."""
    root = tmp_path_factory.mktemp("live")
    done = trainguard("demo", "--live", "--out", str(root), env=worker_env(COLUMNS="200"), timeout=300)
    return root, done


def test_the_live_drill_passes_and_says_so(drill):
    root, done = drill
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "live drill passed" in done.stdout and "quorum changes" in done.stdout
    assert (root / "failed" / "report.html").is_file()


def test_survivors_keep_their_processes_and_the_replacement_is_new(drill):
    root, _ = drill
    pids = defaultdict(list)
    for event in events_of(root / "failed"):
        if event["kind"] == "live_start":
            pids[event["rank"]].append((event["pid"], event["rejoin"]))
    for rank in range(WORLD):
        if rank == KILLED:
            (first, rejoin_first), (second, rejoin_second) = pids[rank]  # the second: the warm spare
            assert first != second and not rejoin_first and rejoin_second
        else:
            assert len(pids[rank]) == 1, pids[rank]
    kill = next(e for e in events_of(root / "failed") if e["kind"] == "live_kill")
    assert kill["pid"] == pids[KILLED][0][0]


def test_quorum_shrinks_to_the_intact_group_then_the_broken_group_rejoins(drill):
    root, _ = drill
    events = events_of(root / "failed")
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    assert quorums[1]["left"] == [2, 3] and quorums[2]["joining"] == [2, 3]
    joined = {e["rank"]: e for e in events if e["kind"] == "live_joined"}
    assert sorted(joined) == [2, 3] and {e["epoch"] for e in joined.values()} == {2}
    # the warm spare took rank 3's place at once: the group rejoined while the survivors were stepping
    assert 10 < joined[3]["step"] < STEPS
    # the survivors stepped on their own, computing the missing group's micro-batches
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {0, 1}
    assert all(len(e["micro_batches"]) == Workload().micro_batches // 2 for e in degraded)
    # as the lost group's ranks of the same positions would have: shard k computes slot k of both groups
    assert {e["rank"]: e["micro_batches"] for e in degraded} == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}


def test_final_parameters_and_optimizer_state_are_bitwise_the_fault_free_ones(drill):
    root, _ = drill
    assert run_differences(root / "clean", root / "failed", WORLD) == {}
    assert replica_differences(root / "clean", WORLD, GROUP) == {}
    assert replica_differences(root / "failed", WORLD, GROUP) == {}
    whole = whole_final_state(root / "clean", GROUP)
    assert {state["step"].item() for state in whole["optimizer"]["state"].values()} == {STEPS}


def test_each_rank_holds_half_of_its_groups_parameters_and_their_optimizer_state(drill):
    """2 ranks per replica group, parameters sharded by rows (FSDP2's ``torch.chunk`` of dim 0): from the
    local shard sizes of every rank's final state, in both runs (the replacement's included), each rank
    holds its rows of every parameter and their optimizer state, the group's shards put together are the
    whole parameters, and every parameter of an even row count is split exactly in half (the output
    layer's single row sits on shard 0, as FSDP2 places it; shard 1 holds FSDP2's padding there)."""
    root, _ = drill
    for run in ("clean", "failed"):
        whole = whole_final_state(root / run, GROUP)["model"]
        states = [safe_torch_load(final_path(root / run, rank)) for rank in range(WORLD)]
        for rank, state in enumerate(states):
            for (name, local), moments in zip(state["model"].items(), state["optimizer"]["state"].values()):
                rows = whole[name].chunk(GROUP)
                expected = rows[rank % GROUP] if rank % GROUP < len(rows) else whole[name][:0]
                assert local.shape == expected.shape and torch.equal(local, expected), (run, rank, name)
                assert moments["exp_avg"].shape == local.shape, (run, rank, name)
                if whole[name].shape[0] % GROUP == 0:
                    assert local.numel() * GROUP == whole[name].numel(), (run, rank, name)
        held = [sum(t.numel() for t in state["model"].values()) for state in states[:GROUP]]
        assert sum(held) == sum(t.numel() for t in whole.values())
        even = sum(t.numel() for t in whole.values() if t.shape[0] % GROUP == 0)
        assert min(held) >= even // GROUP and even > 0.9 * sum(held), (run, held)
    # the joiners received their shard only: shard 0's (305 parameters) more than shard 1's (272), where
    # the whole state would be the same for both, and each less than the group's whole state
    joined = {e["rank"]: e["state_bytes"] for e in events_of(root / "failed") if e["kind"] == "live_joined"}
    whole_bytes = len(serialised({**whole_final_state(root / "failed", GROUP), "guards": {}}))
    assert joined[2] > joined[3] and max(joined.values()) < whole_bytes, (joined, whole_bytes)


def test_no_sample_lost_or_repeated(drill):
    root, _ = drill
    per_step = Workload().samples_per_step
    for name in ("clean", "failed"):
        assert sample_problems(events_of(root / name), STEPS, per_step) == [], name


def test_the_sample_check_sees_a_lost_and_a_repeated_micro_batch(drill):
    root, _ = drill
    events = [e for e in events_of(root / "failed") if e["kind"] == "live_samples"]
    per_step = Workload().samples_per_step
    lost = [e for e in events if not (e["step"] == 12 and e["rank"] == 0)]
    assert any("lost" in p for p in sample_problems(lost, STEPS, per_step))
    repeated = events + [next(e for e in events if e["step"] == 12)]
    assert any("repeated" in p for p in sample_problems(repeated, STEPS, per_step))


def test_the_report_shows_the_quorum_changes_and_their_costs(drill):
    root, _ = drill
    facts = read_run(root / "failed")
    shrink, join = facts.quorum_changes[1:]
    assert shrink.left == [2, 3] and shrink.step == 10 and shrink.survivors_lost_s is not None
    assert join.joining == [2, 3] and join.step is not None and join.step > 10
    assert join.rejoin_s is not None and join.rejoin_s > 0
    page = (root / "failed" / "report.html").read_text()
    assert "Live recovery: quorum changes" in page and "replica group 1 rejoins" in page


def test_a_node_cut_off_is_found_silent_fenced_and_replaced_bitwise(drill, launched, request):
    """Both ranks of replica group 0 (its node) stopped together (SIGSTOP: alive, sockets open, silent,
    as behind a cut link): no collective fails until the lighthouse finds them silent for ``hang_s``,
    has them killed, and group 1 carries on alone as the source of the state; same end state."""
    root, _ = drill
    run, run_dir, result = launched_run(launched, request)
    assert run.hang_s < run.stall_s
    assert [result.last_pids[r] == result.first_pids[r] for r in range(WORLD)] == [False, False, True, True]
    events = events_of(run_dir)
    assert sorted(e["target"] for e in events if e["kind"] == "live_hung") == [0, 1]
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], [2, 3], [0, 1, 2, 3]]
    assert "hung, fenced" in quorums[1]["reason"]
    assert {e["rank"] for e in events if e["kind"] == "live_joined"} == {0, 1}
    assert run_differences(root / "clean", run_dir, WORLD) == {}
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


def test_a_rank_that_dies_while_its_group_is_out_does_not_abort_the_groups_rejoin(drill, launched, request):
    """Rank 3 SIGKILLed after step 10, and rank 2 (its group's survivor, out of the quorum) the moment the
    survivors' epoch is published: both are replaced, and the group rejoins once, in the epoch after (its
    join used to be aborted by rank 2's stale death, "ranks [2] died"). Ranks 0-1 keep their processes;
    the end state is the fault-free run's bit for bit."""
    root, _ = drill
    _, run_dir, result = launched_run(launched, request)
    assert result.shrink_killed_at is not None and result.replacements == {2: 1, 3: 1}
    assert [result.last_pids[r] == result.first_pids[r] for r in range(WORLD)] == [True, True, False, False]
    events = events_of(run_dir)
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [(q["members"], q["joining"]) for q in quorums] == [
        ([0, 1, 2, 3], []), ([0, 1], []), ([0, 1, 2, 3], [2, 3])]
    assert not [e for e in events if e["kind"] == "live_collective_failed" and e["epoch"] == 2]
    assert run_differences(root / "clean", run_dir, WORLD) == {}
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


def test_a_hung_rank_costs_the_survivors_the_stall_bound_not_the_heartbeat_timeout(drill, launched, request):
    """Rank 3 SIGSTOPped while it computes step 10 (alive, sockets open, silent), the heartbeat timeout
    at its default 10 s, twice the stall bound's floor: the stall watch excludes its group and the
    survivors go on at once, without waiting for the report the hung rank never sends (they used to wait
    for ``hang_s``); the hung rank, out of the quorum, is still found silent, killed and replaced, and its
    group rejoins. The launcher writes the epoch before the hang verdict; ranks 0-2 keep their processes;
    the end state is the fault-free run's bit for bit."""
    root, _ = drill
    run, run_dir, result = launched_run(launched, request)
    assert run.hang_s >= 2 * run.stall_s
    assert [result.last_pids[r] == result.first_pids[r] for r in range(WORLD)] == [True, True, True, False]
    events = events_of(run_dir)
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    assert "stalled" in quorums[1]["reason"]
    (hung,) = [e for e in events if e["kind"] == "live_hung"]
    assert hung["target"] == KILLED and events.index(quorums[1]) < events.index(hung)
    assert run_differences(root / "clean", run_dir, WORLD) == {}
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


def test_a_transient_failure_is_undone_and_redone_bitwise_on_another_layout(drill, launched, request):
    """2 replica groups of 1 rank. Rank 0's all-reduce of step 20 fails after rank 1's succeeded: rank 1
    committed step 20, rank 0 did not. Nobody died, so the next epoch keeps both, from step 20; rank 1
    undoes its step 20 and both redo it. The end state equals the 4-rank fault-free run's bit for bit
    (the gradient does not depend on the layout either, nor the update on how it is sharded)."""
    root, _ = drill
    _, run_dir, result = launched_run(launched, request)
    assert result.last_pids == result.first_pids
    events = events_of(run_dir)
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [(q["members"], q["step"], q["reason"]) for q in quorums] == [
        ([0, 1], 0, "start"), ([0, 1], 20, "a collective failed")]
    assert [(e["rank"], e["step"]) for e in events if e["kind"] == "live_undo"] == [(1, 20)]
    assert replica_differences(run_dir, 2, 1) == {}
    whole = whole_final_state(root / "clean", GROUP)
    assert bitwise_differences(whole_final_state(run_dir, 1), whole) == []
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


def test_a_second_failure_during_the_join_sends_the_group_out_again_and_it_rejoins_bitwise(drill, launched, request):
    """Rank 3 is SIGKILLed after step 10; its replacement (a warm spare) is SIGKILLed too as soon as the
    lighthouse lets its group in, before the state transfer finished: rank 2, the other joiner, reports
    no state, the group leaves again, the survivors carry on, and the second spare brings the group back.
    Ranks 0-2 keep their processes; the end state is the fault-free run's, bit for bit."""
    root, _ = drill
    _, run_dir, result = launched_run(launched, request)
    assert result.joiner_killed_at is not None and result.replacements == {KILLED: 2}
    assert all(result.last_pids[r] == result.first_pids[r] for r in range(WORLD) if r != KILLED)
    events = events_of(run_dir)
    kills = [e for e in events if e["kind"] == "live_kill"]
    assert [e["target"] for e in kills] == [KILLED, KILLED] and kills[1].get("during_join") is not None
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [(q["members"], q["joining"]) for q in quorums] == [
        ([0, 1, 2, 3], []), ([0, 1], []), ([0, 1, 2, 3], [2, 3]), ([0, 1], []), ([0, 1, 2, 3], [2, 3])]
    assert quorums[3]["left"] == [2, 3] and quorums[3]["epoch"] == kills[1]["during_join"] + 1
    # rank 2 was let in twice, the first time left with no state; it joined once
    assert [e["step"] for e in events if e["kind"] == "live_collective_failed" and e["rank"] == 2
            and e["epoch"] == kills[1]["during_join"]] == [None]
    assert sorted(e["rank"] for e in events if e["kind"] == "live_joined") == [2, 3]
    assert run_differences(root / "clean", run_dir, WORLD) == {}
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


def test_a_death_while_the_shrunk_epochs_group_is_built_is_recovered_not_escaped(drill, launched, request):
    """3 replica groups of 1 rank. Rank 2 is SIGKILLed after step 10, and rank 1 the moment the lighthouse
    publishes the epoch without rank 2, while rank 0 connects to that epoch's gloo group: rank 0's
    recovery itself is aborted (``EpochAborted`` from the group's build, which used to escape ``recover``
    and end rank 0 too, losing the run), goes on to the next epoch alone, and both groups rejoin. Rank 0
    keeps its process; the end state is the 4-rank fault-free run's bit for bit."""
    root, _ = drill
    _, run_dir, result = launched_run(launched, request)
    assert result.shrink_killed_at is not None and result.replacements == {1: 1, 2: 1}
    assert result.last_pids[0] == result.first_pids[0]
    events = events_of(run_dir)
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums][:3] == [[0, 1, 2], [0, 1], [0]]
    assert quorums[-1]["members"] == [0, 1, 2]
    assert [e["epoch"] for e in events if e["kind"] == "live_resumed" and e["rank"] == 0] == [2]
    whole = whole_final_state(root / "clean", GROUP)
    assert bitwise_differences(whole_final_state(run_dir, 1), whole) == []
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


@pytest.mark.parametrize("stalled, cut, survivors", list(PARTIAL_CUTS.values()), ids=list(PARTIAL_CUTS))
def test_a_partial_cut_is_found_within_the_stall_bound_and_its_group_excluded(drill, launched, request, stalled, cut,
                                                                             survivors):
    """A partial cut: a rank alive, beating and reachable through the store, that its peers cannot
    reach. "absent": rank 3 stays out of its all-reduce of step 10 (from the others' side, a peer
    that never takes part); "cut": rank 1 marks itself in it but is not, and its probe socket is closed
    (the cut inside the collective: the marks cannot tell the side, the probes can; rank 0's group is
    the one excluded). gloo's collective timeout is 120 s, so only the stall watch can explain a
    resume within the stall bound. Nobody is restarted; the excluded group (the same processes)
    rejoins; the end state is the fault-free run's bit for bit."""
    root, _ = drill
    run, run_dir, result = launched_run(launched, request)
    assert result.last_pids == result.first_pids and set(result.exit_codes.values()) == {0}
    events = events_of(run_dir)
    excluded = [r for r in range(WORLD) if r not in survivors]
    drilled = next(e for e in events if e["kind"] == "live_stall_drill")
    assert (drilled["rank"], drilled["step"], drilled["cut"]) == (stalled, 10, cut)
    (stall,) = [e for e in events if e["kind"] == "live_stall"]
    others = [r for r in range(WORLD) if r != stalled]
    if cut:  # everyone in: the marks leave it to the probes, which nobody reached rank 1 in
        assert (stall["waiting"], stall["absent"], stall["excluded"]) == ([0, 1, 2, 3], [], None)
        (reach,) = [e for e in events if e["kind"] == "live_reach"]
        assert reach["excluded"] == excluded
        assert reach["reach"] == {str(r): [p for p in others if p != r] for r in others} | {str(stalled): others}
    else:
        assert (stall["waiting"], stall["absent"], stall["excluded"]) == (others, [stalled], excluded)
        assert not [e for e in events if e["kind"] == "live_reach"]
    assert stall["step"] == 10 and run.stall_s <= stall["bound_s"] <= stall["waited_s"]
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], survivors, [0, 1, 2, 3]]
    assert quorums[1]["step"] == 10 and "stalled" in quorums[1]["reason"] and quorums[2]["joining"] == excluded
    resumed = {e["rank"]: e for e in events if e["kind"] == "live_resumed" and e["epoch"] == 1}
    assert sorted(resumed) == survivors
    # the stall watch ended epoch 0, not gloo's timeout: no survivor's collective failed with gloo's error
    assert not [e for e in events if e["kind"] == "live_collective_failed" and e["epoch"] == 0
                and e["rank"] in survivors and not e["error"].startswith("EpochAborted")]
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == set(survivors)
    assert run_differences(root / "clean", run_dir, WORLD) == {}
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []


def test_a_client_without_the_secret_cannot_stop_abort_fence_or_crash_a_live_run(drill, launched, tmp_path, caplog,
                                                                                   capfd):
    """Issue 40: the fault-free drill run again while a client that reaches its store (and not its
    secret) writes forged stop, abort, fence, report, quorum and join values under the run's own key
    names, and random keys and bytes, and sends garbage to every rank's probe socket. Before the run's
    values were sealed, ``pwned`` under a report key killed the lighthouse (ValueError), a forged
    ``stop`` or ``abort/0`` stopped or broke the epoch. Now: one epoch, no process restarted, the end
    state bitwise the undisturbed run's, every foreign value the run read logged once per process."""
    root, _ = drill
    wait(launched.values())  # no other run of this process beside this one: its log records and stderr are read
    run = dataclasses.replace(FAILING, kill_ranks=(), spares=0)
    with caplog.at_level(logging.WARNING, logger="trainguard.live.store"), LiveAttack(tmp_path / "attacked", WORLD) as attack:
        result = launch(tmp_path / "attacked", run)
    assert attack.error is None, attack.error
    assert {"stop", "abort/0", "report/0/1"} <= attack.written and len(attack.written) > 30, sorted(attack.written)
    assert attack.probed == set(range(WORLD)) and attack.overwrote_latest > 10
    assert result.first_pids == result.last_pids and result.exit_codes == {r: 0 for r in range(WORLD)}
    events = events_of(tmp_path / "attacked")
    assert [e["members"] for e in events if e["kind"] == "live_quorum"] == [[0, 1, 2, 3]]
    assert run_differences(root / "clean", tmp_path / "attacked", WORLD) == {}
    assert sample_problems(events, STEPS, Workload().samples_per_step) == []
    # the lighthouse (this process) read the forged reports of epoch 0 at every look: one line each
    launcher = [r.getMessage() for r in caplog.records if r.name == "trainguard.live.store"]
    assert launcher.count("trainguard: ignored a foreign value under live store key 'report/0/1' "
                          "(not sealed with the run secret): b'pwned'") == 1
    assert len(launcher) == len(set(launcher)) and any("'report/0/" in line for line in launcher), launcher
    # every rank polled the forged stop at every step: one line per rank
    ranks = [line for line in capfd.readouterr().err.splitlines() if "foreign value under live store key 'stop'" in line]
    assert 1 <= len(ranks) <= WORLD, ranks
