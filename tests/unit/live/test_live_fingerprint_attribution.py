"""``live/fingerprint.LiveFingerprints``' recompute, completed as the closure mode's, on two ranks of a real
gloo group (threads, ``helpers.gloo_threads``), two replicas of one shard:

- the attribution by recompute: the replicas disagree with neither changed at rest (the corruption entered
  an update); each keeps a host copy of the tensors that differ, and once the recompute reached the check
  step again, the distance of each copy to the recomputed tensor names the rank whose first computation
  was wrong: logged, reported, and struck in every member's strike book alike (``guards.sdc`` on);
- ``restored_agrees``: a state restored from a durable save whose check hashed it otherwise on any member
  is refused by every member alike, and ``guards.fingerprint.restore_agreeing`` passes that checkpoint over
  for an older one, with the closure mode's line.

Without the copies (``before_recompute`` never filled) the first fails (no ``recompute`` mismatch, no
strike), and with ``restored_agrees`` answering True the second: both checked once by hand."""

from __future__ import annotations

import copy
import logging

import torch

from helpers.gloo_threads import run_ranks
from trainguard.events.log import EventLog, read_events
from trainguard.guards.fingerprint import FingerprintConfig, restore_agreeing
from trainguard.guards.sdc import SdcConfig
from trainguard.live.fingerprint import LiveFingerprints
from trainguard.live.quorum import Quorum
from trainguard.live.sdc import LiveSdc

STEP = 6  # the check before it is due (interval 3)
QUORUM = Quorum(epoch=0, members=[0, 1], start_step=0, reason="test")


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.ones(3, 4)).square().mean().backward()
    optimizer.step()
    return model, optimizer


TRAINED = _trained()


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One rank's replica: the same model and Adam state on every rank (copied: the ranks are threads of one
    process, whose random generator they would share)."""
    return copy.deepcopy(TRAINED)


def fingerprints_of(rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir,
                    sdc: bool) -> LiveFingerprints:
    events = EventLog(run_dir / "events.jsonl", rank=rank)
    log = logging.getLogger(f"test_live_fingerprint_attribution.{rank}")
    book = None
    if sdc:
        config = SdcConfig(enabled_level=2, strikes=2)
        config.validate()
        book = LiveSdc(config, model, 2, rank=rank, run_dir=run_dir, log=log, events=events, reports=lambda: rank == 0)
    # no repair here (nothing attributed is repaired from a replica): ``state`` is not needed
    return LiveFingerprints(FingerprintConfig(interval=3), model, optimizer, None, rank, 1, log, events,
                            lambda: rank == 0, book)


def wait(work) -> None:
    work.wait()


def test_the_recompute_names_the_rank_whose_first_computation_was_wrong_and_strikes_it(tmp_path, caplog):
    recomputed_weight = {}

    def rank_side(group, rank):
        model, optimizer = trained()
        fingerprints = fingerprints_of(rank, model, optimizer, tmp_path, sdc=True)
        weight = model[0].weight
        recomputed_weight[rank] = weight.detach().clone()
        fingerprints.remember(STEP)  # the state right after the update before the check: nothing moves at rest
        if rank == 0:  # this rank's update went wrong: its weight is off, not changed at rest
            with torch.no_grad():
                weight.add_(0.5)
            fingerprints.remember(STEP)
        verdict = fingerprints.check(group, QUORUM, STEP, wait)
        asked = fingerprints.recompute
        copied = sorted(fingerprints.before_recompute)
        fingerprints.recomputing_from(STEP, 3)
        with torch.no_grad():  # the recompute from the checkpoint of step 3: the right weight, on both
            weight.copy_(recomputed_weight[rank])
        fingerprints.remember(STEP)
        again = fingerprints.check(group, QUORUM, STEP, wait)
        return [(m.faulty, m.how) for m in verdict.mismatches], asked, copied, again.clean, fingerprints.recompute

    with caplog.at_level(logging.ERROR):
        results = run_ranks([0, 1], rank_side)
    for rank in (0, 1):
        found, asked, copied, clean_after, asked_again = results[rank]
        assert found == [((), "unattributed")] and asked  # nothing attributes it: a recompute is asked
        assert copied == [0]  # param:0.weight only, the one place whose hash differs
        assert clean_after and not asked_again  # recomputed alike, nothing asked again
    assert caplog.text.count(f"fingerprint mismatch: step {STEP}, replica group [0, 1], tensor param:0.weight: "
                             "rank(s) [0] corrupt (recompute), repaired by the recompute") == 2  # both members
    assert caplog.text.count(f"sdc strike: step {STEP}, rank 0: fingerprint mismatch (recompute); strike 1 of 2 "
                             "within 8 h") == 2  # every member's book alike
    reported = [(e["step"], e["tensors"], e["faulty"], e["how"], e["repaired"])
                for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "fingerprint_mismatch"]
    assert reported == [(STEP, ["state"], [], ["unattributed"], []),
                        (STEP, ["param:0.weight"], [0], ["recompute"], ["param:0.weight"])]


def test_a_restored_state_that_does_not_hash_as_its_save_held_it_is_passed_over(tmp_path, caplog):
    def rank_side(group, rank):
        model, optimizer = trained()
        fingerprints = fingerprints_of(rank, model, optimizer, tmp_path, sdc=False)
        weight = model[0].weight
        saved = {}
        for step in (2, 4):  # two durable saves, each checked first (the digests the restores compare with)
            with torch.no_grad():
                weight.add_(1.0)
            assert fingerprints.before_save(group, QUORUM, step, wait, None) is None
            saved[step] = weight.detach().clone()
        restores = []

        def roll_back(before: int) -> int | None:
            """The newest checkpoint before ``before``, loaded; rank 1's copy of step 4 was corrupted before
            the save's copy was made (the checkpoint holds it, its manifest agrees)."""
            step = max((s for s in saved if s < before), default=None)
            restores.append(step)
            if step is not None:
                with torch.no_grad():
                    weight.copy_(saved[step])
                    if step == 4 and rank == 1:
                        weight.view(torch.int32)[0, 0] ^= 1 << 20
            return step

        agrees = {step: fingerprints.restored_agrees(group, QUORUM, step, wait) for step in (4, 2, 0)}
        restored = restore_agreeing(STEP, roll_back,
                                    lambda step: fingerprints.restored_agrees(group, QUORUM, step, wait),
                                    fingerprints.log)
        return agrees, restored, restores

    with caplog.at_level(logging.ERROR):
        results = run_ranks([0, 1], rank_side)
    for rank in (0, 1):
        agrees, restored, restores = results[rank]
        # as it is now (step 4's state, unchanged): 4 agrees; 2 does not; no save of step 0 was hashed: agrees
        assert agrees == {4: True, 2: False, 0: True}
        assert (restored, restores) == (2, [4, 2])  # step 4 refused on rank 1: refused by both, step 2 taken
    assert caplog.text.count("global_step_4 does not hold the state hashed right after its update (memory changed "
                             "before its copy was made): not recomputed from") == 2


def test_restore_agreeing_with_nothing_left_restores_nothing(caplog):
    with caplog.at_level(logging.ERROR):
        restored = restore_agreeing(5, lambda before: {5: 4, 4: None}[before], lambda step: False,
                                    logging.getLogger("test_live_fingerprint_attribution"))
    assert restored is None
    assert "global_step_4 does not hold the state hashed" in caplog.text
