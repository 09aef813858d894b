"""Live recovery on other nodes when a node command itself fails (issue 35, item 4): the launcher tells a
node that cannot start a rank (its node command ends before the rank reached the store: here ``ip netns
exec`` into a network namespace that does not exist, exit 255 at once, as an ``ssh`` that cannot connect)
from a rank's death, marks the node lost (``live_node_lost``) and starts the rank on another node; with
no node left it ends with one line naming the nodes and their commands' errors.

The run: ``tests/helpers/live_loop.py`` (dropout, AdamW), 2 replica groups x 1, 8 steps, a durable save
every 3, stopped at step 3 on this machine (``train.exit_at_step``), then resumed (``--resume auto``)
through ``trainguard run --launcher hosts`` on the suite's network-namespace nodes
(``helpers/netns_cluster.py``) n1 and n4, spare nodes n5 and n3: n4 and n5 are names the fixture never
made, so rank 1's node command and the warm spare's fail at once. Before the fix, rank 1's replacements
were started on n4 again, each failing there, until ``LiveRun.max_replacements``; and a rank that died
before the first epoch's group was built ended the others (``EpochAborted``).

A node command can also end after its rank reached the store, with ssh's own code 255 either way: its
rank died (ssh reports a rank killed by a signal so), or the command dropped (a lost ssh connection) while
the rank runs on. The launcher tells them apart by the rank's heartbeat (``live/node_watch.py``): the same
run on two loopback "hosts" behind ``sh`` wrappers standing in for ssh, rank 0's wrapper SIGKILLs its rank
and exits 255, rank 1's exits 255 while its rank runs on (its lifeline, stdin, kept): rank 0 is replaced on
its node, rank 1 is kept (``live_node_command_lost``), and the run ends bitwise equal to the fault-free run.
Before the fix, rank 1 was taken for dead and replaced while it ran on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.runs import trainguard, worker_env
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "tests" / "helpers" / "live_loop.py"
STEPS, STOPPED_AT = 8, 3
CONFIG = ("parallel: {dp_replicate: 2}\n"
          f"train: {{steps: {STEPS}, micro_batches: 4}}\n"
          "fault_tolerance: {live: true, spares: 1, doctor_spares: false}\n"
          f"checkpoint: {{save_interval: {STOPPED_AT}}}\n")
MISSING = "Cannot open network namespace \"{}\": No such file or directory"


def _run(config: Path, run_dir: Path, *options: str) -> list[str]:
    return ["run", *options, "--nproc", "2", "--config", str(config), "--run-dir", str(run_dir), "--",
            sys.executable, str(LOOP), "--config", str(config)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_node_lost")
    (root / "live.yaml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def clean(root):
    """The fault-free run, on this machine, with no stop."""
    done = trainguard(*_run(root / "live.yaml", root / "clean"), timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "clean"


@pytest.fixture(scope="module")
def lost_node_run(netns, root):
    config = root / "live.yaml"
    first = trainguard(*_run(config, root / "lost", "--set", f"train.exit_at_step={STOPPED_AT}"), timeout=200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    hosts = ",".join(f"{node}={netns.address(node) if node in ('n1', 'n3') else '10.231.0.9'}"
                     for node in ("n1", "n4", "n5", "n3"))
    code, output = netns.run_on_head([sys.executable, "-m", "trainguard", *_run(
        config, root / "lost", "--launcher", "hosts", "--hosts", hosts, "--node-command", netns.node_command())],
        worker_env(GLOO_SOCKET_IFNAME="tg0"), root / "lost.out")
    return root, code, output, netns.ns("n4")


def test_a_node_whose_command_fails_is_lost_and_its_rank_starts_on_the_spare_node(lost_node_run):
    root, code, output, n4 = lost_node_run
    assert code == 0, output[-4000:]
    assert f"live run resumes from {root / 'lost' / 'checkpoints' / f'global_step_{STOPPED_AT}'}" in output
    assert f"live run finished: {STEPS} steps in " in output and "ranks replaced: [1]" in output, output[-4000:]
    assert "unsupervised" not in output  # the resume's verification joined its threads just before (supervise.py)
    events = list(read_events(events_path(root / "lost")))
    lost = {e["node"]: e for e in events if e["kind"] == "live_node_lost"}
    assert sorted(lost) == ["n4", "n5"], lost
    for node, event in lost.items():
        assert (event["reason"], event["exit_code"], event["error"]) == (
            "node_command_failed", 255, MISSING.format(n4[:-1] + node[-1])), event
    assert lost["n4"]["target"] == 1 and MISSING.format(n4) in output  # the command's own line, relayed
    # the warm spare on n5 never ran: passed over (or, when rank 1's end was seen before the spare's, handed
    # rank 1 and lost with it); rank 1 then started cold on the spare node n3
    excluded = [(e["spare"], e["reason"]) for e in events if e["kind"] == "live_spare_excluded"]
    assert excluded in ([(0, "its node is lost")], []) and (excluded == []) == ("target" in lost["n5"]), lost["n5"]
    assert [(e["target"], e["node"]) for e in events if e["kind"] == "live_replacement"] == [(1, "n3")]
    # on the nodes (the UTS name of each process): rank 0 once on n1, rank 1 once, on n3
    resumed = max(e["time"] for e in events if e["kind"] == "live_store")
    starts = sorted((e["rank"], e["host"], e["rejoin"]) for e in events
                    if e["kind"] == "live_start" and e["time"] > resumed)
    assert starts == [(0, "n1", False), (1, "n3", True)], starts


def test_the_survivor_resumes_from_the_checkpoint_and_the_run_ends_bitwise_equal_to_the_fault_free_run(
        lost_node_run, clean):
    """Rank 1's early death ended the first epoch before its group was built: rank 0 went on to the next
    one and resumed there from global_step_3, steps 3 to 7 trained once each after the restart."""
    root = lost_node_run[0]
    events = list(read_events(events_path(root / "lost")))
    resumed = max(e["time"] for e in events if e["kind"] == "live_store")
    stepped = sorted({e["step"] for e in events if e["kind"] == "live_step" and e["time"] > resumed and e["rank"] == 0})
    assert stepped == list(range(STOPPED_AT, STEPS)), stepped  # 0-based: steps 3 to 7
    assert run_differences(clean, root / "lost", 2) == {}
    assert replica_differences(root / "lost", 2, 1) == {}


def test_with_no_node_left_the_run_ends_in_one_line_naming_the_nodes_and_their_commands_errors(tmp_path):
    """Every host's node command fails (a stand-in for ``ssh`` that cannot connect): no rank ever starts, and
    ``trainguard run`` ends at once (exit 1) instead of starting replacements until max_replacements."""
    node_command = ("sh -c 'echo \"ssh: connect to host $0 port 22: Connection refused\" >&2; exit 255' {address}")
    (tmp_path / "live.yaml").write_text("fault_tolerance: {live: true}\nparallel: {dp_replicate: 2}\n"
                                        "train: {steps: 4, micro_batches: 2}\n")
    done = trainguard("run", "--launcher", "hosts", "--hosts", "a=127.0.0.1,b=127.0.0.2", "--node-command", node_command,
                      "--nproc", "2", "--config", str(tmp_path / "live.yaml"), "--run-dir", str(tmp_path / "run"),
                      "--", sys.executable, str(ROOT / "tests" / "helpers" / "live_loop.py"), timeout=120)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("trainguard: error: live run: no node left to start rank "), errors
    for node, address in (("a", "127.0.0.1"), ("b", "127.0.0.2")):
        assert f"{node} (sh exited 255: ssh: connect to host {address} port 22: Connection refused)" in errors[0]


# ssh's part in the test: node a's first command SIGKILLs its rank once the run has stepped, then exits 255;
# node b's exits 255 then while its rank runs on, its stdin (the launcher's lifeline) still held (a command put in
# the background reads /dev/null unless given the shell's own stdin by another descriptor)
SSH_DROPS = """mark={root}/dropped-$0
if [ -e "$mark" ]; then exec "$@"; fi
touch "$mark"
exec 3<&0
"$@" <&3 3<&- &
rank=$!
until grep -q live_step {events} 2>/dev/null; do sleep 0.05; done
if [ "$0" = a ]; then kill -9 $rank; wait $rank; fi
echo "Connection to $0 closed by remote host." >&2
exit 255"""


def test_a_dropped_node_command_keeps_its_running_rank_and_a_dead_ranks_255_is_its_death(root, clean):
    run_dir = root / "dropped"
    wrapper = SSH_DROPS.format(root=root, events=events_path(run_dir))
    # rank 0 stands still 3 s at step 2 (alive): the wrappers act while the run is under way
    done = trainguard(*_run(root / "live.yaml", run_dir, "--launcher", "hosts", "--hosts", "a=127.0.0.1,b=127.0.0.2",
                            "--node-command", f"sh -c '{wrapper}' {{node}}", "--set", "fault_tolerance.spares=0",
                            "--set", "faults=hang:rank=0,step=2,seconds=3"), timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ranks replaced: [0]" in done.stdout, done.stdout[-3000:]
    events = list(read_events(events_path(run_dir)))
    [lost] = [e for e in events if e["kind"] == "live_node_command_lost"]
    assert (lost["target"], lost["node"], lost["code"], lost["error"]) == (1, "b", 255, "Connection to b closed by remote host.")
    assert [(e["target"], e["code"]) for e in events if e["kind"] == "live_exit"] == [(0, 255)]
    assert [(e["target"], e["node"]) for e in events if e["kind"] == "live_replacement"] == [(0, "a")]
    assert not [e for e in events if e["kind"] == "live_node_lost"]
    assert len({e["pid"] for e in events if e["kind"] == "live_start" and e["rank"] == 1}) == 1  # kept
    assert run_differences(clean, run_dir, 2) == {}
