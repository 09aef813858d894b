"""A live run's fault drill in the faults grammar (``trainguard.live.drill``): ``kill:rank=R,step=S``
entries become the launcher's SIGKILL (``LiveRun.kill_ranks``, ``kill_at_step``), from the config key
``faults`` or ``TRAINGUARD_FAULTS`` (which wins); every other kind is the ranks' own (a ``wipe`` too, of a
node of the local tier); an entry a live run does not drill is one error naming the source and the entry,
on the launcher's side (``LiveRun.from_config``) and on a rank's (``Guard`` in live mode)."""

from __future__ import annotations

import pytest
import torch

import trainguard
from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.faults.injector import ENV_VAR
from trainguard.faults.spec import KINDS
from trainguard.live.drill import (CHECKPOINT_FAULT_KINDS, GRADIENT_FAULT_KINDS, LIVE_FAULT_KIND, SITE_FAULT_KINDS,
                                   SPARE_FAULT_KIND, WIPE_FAULT_KIND, gradient_faults, live_drill, local_tier_nodes,
                                   site_faults)
from trainguard.live.launcher import LiveRun

LIVE_LAYOUT = ["fault_tolerance.live=true", "parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batches=8",
               "train.steps=20"]


@pytest.fixture(autouse=True)
def no_faults_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_the_config_keys_kill_is_the_launchers_kill_of_that_rank_after_that_step():
    run = LiveRun.from_config(load_config(None, [*LIVE_LAYOUT, "faults=kill:rank=3,step=5"]))
    assert (run.kill_ranks, run.kill_at_step, run.fault) == ((3,), 5, "kill")
    assert LiveRun.from_config(load_config(None, LIVE_LAYOUT)).kill_ranks == ()


def test_a_nodes_ranks_are_killed_together_and_the_environment_wins(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "kill:rank=2,step=7; kill:rank=3,step=7")
    run = LiveRun.from_config(load_config(None, [*LIVE_LAYOUT, "faults=kill:rank=1,step=4"]))
    assert (run.kill_ranks, run.kill_at_step) == ((2, 3), 7)


@pytest.mark.parametrize("faults, message", [
    ("wipe:node=0,step=3", "bad fault 'wipe:node=0,step=3': the local tier is off (set checkpoint.local_interval)"),
    ("corrupt:step=21,file=*.distcp", "step must be between 1 and train.steps = 20"),
    ("hang:rank=4,step=3", "rank 4 is outside the world size 4"),
    ("hang:rank=1,step=3,node=node0", "a live run's hang names its rank; leave out node="),
    ("scale:rank=4,step=3,site=0,where=grad_input,factor=2", "rank 4 is outside the world size 4"),
    ("bitflip:rank=1,step=21,site=0,where=output", "step must be between 1 and train.steps = 20"),
    ("scale:rank=1,step=3,site=0,where=output,factor=2,node=node0", "a live run's scale names its rank; leave "
                                                                    "out node="),
    ("spike:step=3,node=node0", "a live run's spike hits the step's summed gradient on every rank alike; leave "
                                "out node="),
    ("spike:step=21", "step must be between 1 and train.steps = 20"),
    ("kill:rank=1,step=3,persistent=1", "a live run's kill takes rank and step only"),
    ("kill:rank=1,step=3,node=node0", "a live run's kill takes rank and step only"),
    ("kill:rank=4,step=3", "rank 4 is outside the world size 4"),
    ("kill:rank=1,step=0", "step must be between 1 and train.steps - 1 = 19"),
    ("kill:rank=1,step=20", "step must be between 1 and train.steps - 1 = 19"),
    ("kill:rank=1,step=3;kill:rank=2,step=4", "a live run's kills hit their ranks together (a node's), so they "
                                              "name one step"),
    ("kill:rank=1", "missing required key step for kill"),
])
def test_what_a_live_run_does_not_drill_is_one_error_naming_the_entry(faults, message):
    with pytest.raises(ConfigError, match=r"^config key 'faults': ") as error:
        live_drill(faults, world=4, steps=20)
    assert message in str(error.value)


def test_a_miscompute_entry_is_the_spares_self_test_fault_and_names_a_spare():
    run = LiveRun.from_config(load_config(None, [*LIVE_LAYOUT, "fault_tolerance.spares=2",
                                                 "faults=kill:rank=3,step=5; miscompute:rep=0,rank=1"]))
    assert (run.kill_ranks, run.spare_faults, run.doctor_spares) == ((3,), "miscompute:rep=0,rank=1", True)
    assert live_drill("miscompute:rep=2", world=4, steps=20) == {"spare_faults": "miscompute:rep=2"}
    for spares, faults in ((2, "miscompute:rep=0,rank=2"), (0, "miscompute:rep=0")):
        with pytest.raises(ConfigError, match=rf"^config key 'faults': fault '{faults}': in a live run, miscompute "
                                              rf"acts in the warm spares' self-test and rank= names a spare; this "
                                              rf"run has {spares} spares"):
            live_drill(faults, world=4, steps=20, spares=spares)


def test_a_rank_in_live_mode_leaves_the_kill_to_the_launcher_and_refuses_any_other_fault(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    argv = ["--store", "127.0.0.1:1", "--rank", "1", "--world", "4", "--steps", "12", "--run-dir", str(tmp_path),
            "--micro-batches", "8"]
    config = load_config(None, ["fault_tolerance.live=true", "faults=kill:rank=3,step=5"])
    assert trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=argv).micro_batches == 8
    monkeypatch.setenv(ENV_VAR, "wipe:node=0,step=3")  # the local tier is off in this config
    with pytest.raises(ConfigError, match=rf"^{ENV_VAR}: bad fault 'wipe:node=0,step=3': the local tier is off"):
        trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=argv)
    monkeypatch.setenv(ENV_VAR, "spike:step=3")  # a gradient fault: the rank's own (tests/integration/test_live_guards.py)
    spiked = trainguard.Guard(tmp_path, model, optimizer, config=config, live_argv=argv)
    assert [spec.text for spec in spiked._live.rules.gradient_faults] == ["spike:step=3"]


def test_gradient_faults_are_the_ranks_not_the_launchers():
    """``spike`` and ``nan`` pass the drill's check and reach no launcher field: each rank applies them to the
    step's summed gradient (``LiveWorker.step``; tests/integration/test_live_guards.py)."""
    faults = "spike:step=3,factor=100; nan:step=5; kill:rank=1,step=4"
    run = LiveRun.from_config(load_config(None, [*LIVE_LAYOUT, f"faults={faults}"]))
    assert (run.kill_ranks, run.kill_at_step) == ((1,), 4)
    # every rank's, a nan's default rank=0 too: a NaN on one rank's sum alone would split the verdicts
    assert [(spec.kind, spec.step, spec.rank) for spec in gradient_faults(faults)] == [("spike", 3, None),
                                                                                       ("nan", 5, None)]


def test_module_faults_are_one_ranks_own_and_reach_no_launcher_field():
    """``bitflip`` and ``scale`` pass the drill's check and reach no launcher field: the rank they name applies
    them at its module, once (``LiveWorker.compute``; tests/integration/test_live_sdc.py)."""
    faults = ("scale:rank=1,step=4,site=2,where=grad_input,factor=1e9; bitflip:rank=2,step=5,site=0,where=output; "
              "hang:rank=3,step=6; corrupt:step=7,file=*.distcp")  # a hang and a checkpoint's damage too: the
    # rank's injector's (the rank stops itself; the quorum's first member damages the commit; test_live_guards.py)
    assert live_drill(faults, world=4, steps=20) == {}
    assert [(spec.kind, spec.rank, spec.step) for spec in site_faults(faults)] == [
        ("scale", 1, 4), ("bitflip", 2, 5), ("hang", 3, 6), ("corrupt", None, 7)]
    assert site_faults("spike:step=3; kill:rank=1,step=4") == ()


def test_every_kind_of_the_faults_grammar_is_drilled_in_a_live_run():
    """No kind is refused as the closure mode's only (the last one was ``wipe``): a kind added to the grammar
    must be given its place in live mode too."""
    live = {LIVE_FAULT_KIND, SPARE_FAULT_KIND, WIPE_FAULT_KIND, *GRADIENT_FAULT_KINDS, *SITE_FAULT_KINDS,
            *CHECKPOINT_FAULT_KINDS}
    assert live == set(KINDS)


def test_a_wipe_is_the_ranks_own_and_names_a_node_of_the_local_tier():
    """``wipe:node=N,step=S``: node N is the local tier's (``rank // parallel.ranks_per_node``), its first member of
    the quorum deletes (``LiveCheckpoints``; tests/integration/test_live_durable.py); refused in one line when the
    local tier is off or node N does not exist, by the launcher and by each rank."""
    assert local_tier_nodes(2, 2, 4) == 2 and local_tier_nodes(2, None, 4) == 1 and local_tier_nodes(0, 2, 4) is None
    assert local_tier_nodes(2, 8, 4) == 1 and local_tier_nodes(2, 3, 4) == 2  # a node of fewer ranks counts
    assert live_drill("wipe:node=1,step=4", world=4, steps=20, local_nodes=2) == {}
    assert [(spec.kind, spec.params, spec.step) for spec in site_faults("wipe:node=1,step=4")] == [
        ("wipe", {"node": 1}, 4)]
    with pytest.raises(ConfigError, match=r"^config key 'faults': bad fault 'wipe:node=2,step=4': node 2 does not "
                                          r"exist \(nodes 0..1; see parallel.ranks_per_node\)$"):
        live_drill("wipe:node=2,step=4", world=4, steps=20, local_nodes=2)
    with pytest.raises(ConfigError, match=r"^config key 'faults': bad fault 'wipe:node=1,step=4': the local tier is "
                                          r"off \(set checkpoint.local_interval\)$"):
        live_drill("wipe:node=1,step=4", world=4, steps=20)
    layout = [*LIVE_LAYOUT, "checkpoint.local_interval=2", "parallel.ranks_per_node=2"]
    assert LiveRun.from_config(load_config(None, [*layout, "faults=wipe:node=1,step=4"])).kill_ranks == ()
    with pytest.raises(ConfigError, match=r"bad fault 'wipe:node=2,step=4': node 2 does not exist"):
        LiveRun.from_config(load_config(None, [*layout, "faults=wipe:node=2,step=4"]))
