"""Replica fingerprints: the hash sees every single bit flip; attribution by majority and at rest."""

import logging
import random

import pytest
import torch
from torch import nn

from trainguard.errors import ConfigError
from trainguard.faults.bits import flip_bit
from trainguard.guards.fingerprint import (
    RECOMPUTE_RATIO,
    FingerprintConfig,
    Mismatch,
    attribute_by_recompute,
    compare_replicas,
    distance,
    fingerprints,
    replica_partition,
    tensor_fingerprint,
    word_sums,
)
from trainguard.guards.state_guard import StateGuard
from trainguard.guards.state_health import (
    local_state,
    merge_health,
    nonfinite_state,
    poisoned_health,
    state_save_health,
)
from trainguard.guards.step_slots import Slot, local_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 3, 1023, 2048 * 3 + 7])
def test_every_single_bit_flip_changes_the_fingerprint(dtype, numel):
    rng = random.Random(numel)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    clean = tensor_fingerprint(tensor)
    width = tensor.element_size() * 8
    for _ in range(40):
        flipped = tensor.clone()
        flip_bit(flipped, rng.randrange(numel), rng.randrange(width))
        assert not torch.equal(tensor_fingerprint(flipped), clean)
    assert torch.equal(tensor_fingerprint(tensor.clone()), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 3, 1024, 2048 * 3 + 7])
def test_every_single_bit_flip_changes_the_word_sums_and_an_offset_view_takes_the_general_path(dtype, numel):
    rng = random.Random(numel)
    tensor = torch.randn(numel + 1, generator=torch.Generator().manual_seed(numel)).to(dtype)
    for part in (tensor[:numel], tensor[1:]):  # the second starts off an 8-byte boundary
        clean = word_sums([("t", part)])
        assert torch.equal(clean, torch.stack([tensor_fingerprint(part.clone())[0]]))
        for _ in range(20):
            flipped = part.clone()
            flip_bit(flipped, rng.randrange(numel), rng.randrange(part.element_size() * 8))
            assert not torch.equal(word_sums([("t", flipped)]), clean)


def test_swapped_elements_change_the_fingerprint():
    tensor = torch.arange(5000, dtype=torch.float32)
    swapped = tensor.clone()
    swapped[[3, 4000]] = swapped[[4000, 3]]
    assert not torch.equal(tensor_fingerprint(swapped), tensor_fingerprint(tensor))


def hashes_of(values):
    return {rank: [(v, 0) for v in row] for rank, row in values.items()}


def test_agreeing_replicas_are_clean():
    verdict = compare_replicas(["a", "b"], hashes_of({0: [1, 2], 4: [1, 2], 8: [1, 2]}))
    assert verdict.clean and verdict.faulty_ranks == () and verdict.repairable


def test_majority_of_three_attributes_the_odd_one_and_repairs_from_an_agreeing_one():
    verdict = compare_replicas(["a", "b"], hashes_of({0: [1, 2], 4: [1, 9], 8: [1, 2]}))
    assert verdict.mismatches == (Mismatch("b", (4,), 0, "majority"),)
    assert verdict.faulty_ranks == (4,) and verdict.repairable


def test_two_replicas_are_attributed_by_the_rank_whose_memory_changed_at_rest():
    names = ["a", "b"]
    hashes = hashes_of({0: [1, 2], 1: [1, 7]})
    verdict = compare_replicas(names, hashes, {0: [False, False], 1: [False, True]})
    assert verdict.mismatches == (Mismatch("b", (1,), 0, "at_rest"),)
    unattributed = compare_replicas(names, hashes, {0: [False, False], 1: [False, False]})
    assert unattributed.mismatches == (Mismatch("b", (), None, "unattributed"),)
    assert not unattributed.repairable and unattributed.faulty_ranks == ()


def test_without_replicas_a_change_at_rest_is_attributed_but_cannot_be_repaired():
    verdict = compare_replicas(["a"], hashes_of({3: [5]}), {3: [True]})
    assert verdict.mismatches == (Mismatch("a", (3,), None, "at_rest"),) and not verdict.repairable
    assert compare_replicas(["a"], hashes_of({3: [5]}), {3: [False]}).clean


def test_after_a_recompute_the_rank_whose_state_changed_is_the_faulty_one():
    # exact: rank 0's old tensor equals its recompute (the corruption stayed on rank 1, e.g. an Adam moment)
    verdict = attribute_by_recompute(["a", "b"], {0: [0.0, 0.0], 1: [0.0, 3e-4]})
    assert verdict.mismatches == (Mismatch("b", (1,), 0, "recompute"),) and verdict.repairable
    # the all-reduced gradient moved rank 0 too, far less than the flip itself
    leaked = attribute_by_recompute(["a"], {0: [1e-6], 1: [RECOMPUTE_RATIO * 1e-6]})
    assert leaked.mismatches == (Mismatch("a", (1,), 0, "recompute"),)
    # comparable distances (or a computation that is not deterministic): nothing to tell them apart
    unclear = attribute_by_recompute(["a"], {0: [1e-6], 1: [2e-6]})
    assert unclear.mismatches == (Mismatch("a", (), None, "unattributed"),) and not unclear.repairable
    assert attribute_by_recompute(["a"], {0: [0.0], 1: [0.0]}).clean


def test_distance_is_the_largest_difference_and_infinite_for_a_nan():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert float(distance(a, torch.tensor([1.0, 2.5, 3.0]))) == 0.5
    assert float(distance(a, torch.tensor([1.0, float("nan"), 3.0]))) == float("inf")
    assert float(distance(torch.zeros(0), torch.zeros(0))) == 0.0


def test_replica_partition_is_sorted_and_deduplicated():
    assert replica_partition([(2, 0), (1, 3), (0, 2)]) == [(0, 2), (1, 3)]


def test_local_state_lists_weights_and_adam_moments_and_finds_a_nan():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    named = local_state(model, optimizer)
    names = [name for name, _ in named]
    assert names == ["param:weight", "param:bias", "exp_avg:weight", "exp_avg_sq:weight",
                     "exp_avg:bias", "exp_avg_sq:bias"]
    assert fingerprints(named).shape == (6, 2)
    assert nonfinite_state(named) == []
    optimizer.state[model.bias]["exp_avg"][1] = float("inf")
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert nonfinite_state(local_state(model, optimizer)) == ["param:weight", "exp_avg:bias"]


def test_poisoned_health_marks_the_save_unhealthy_and_merges_with_the_embedding_verdict():
    assert poisoned_health(0) is None
    poisoned = poisoned_health(2, ["param:w", "exp_avg:w"])
    assert poisoned["is_health"] == 1 and poisoned["nonfinite_tensors"] == 2
    assert merge_health(None, None) is None
    assert merge_health({"is_health": 0, "embedding_local_norm": 0.1}, None)["is_health"] == 0
    merged = merge_health({"is_health": 0, "embedding_local_norm": 0.1}, poisoned)
    assert merged["is_health"] == 1 and merged["embedding_local_norm"] == 0.1


def test_a_saves_state_verdict_names_what_no_replica_repaired_as_both_modes_record_it(caplog):
    """``state_save_health``: the closure mode's ``before_save`` and the live mode's record the same fields,
    and an unhealthy verdict is one error line naming the step."""
    log = logging.getLogger("trainguard.test")
    embedding = {"is_health": 0, "embedding_local_norm": 0.1}
    with caplog.at_level(logging.ERROR, logger="trainguard.test"):
        assert state_save_health(None, 0, [], 0, 0, 3, log) is None
        assert state_save_health(embedding, 0, [], 0, 0, 3, log) == embedding
        assert not caplog.records
        assert state_save_health(embedding, 0, [], 2, 2, 4, log) == {
            "is_health": 1, "embedding_local_norm": 0.1, "reason": "replicas disagree", "fingerprint_groups": 2}
        assert [r.getMessage() for r in caplog.records] == [
            "checkpoint of step 4 is unhealthy and will not be resumed from: {'embedding_local_norm': 0.1, "
            "'reason': 'replicas disagree', 'fingerprint_groups': 2}"]
    assert state_save_health(None, 0, [], 1, 0, 5, log)["reason"] == "state changed at rest"
    assert state_save_health(None, 1, ["param:w"], 0, 0, 6, log) == poisoned_health(1, ["param:w"])


def _updated_once() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded model after one AdamW update (its optimizer state filled)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _state_guard(interval: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> StateGuard:
    """One rank without a replica, fingerprints every ``interval`` steps (0: off)."""
    return StateGuard(FingerprintConfig(interval=interval), model, optimizer, [(0,)], 0, logging.getLogger("test"),
                      lambda *args, **kwargs: None)


def test_a_restored_state_agrees_only_when_it_hashes_as_it_did_right_after_that_steps_update():
    """The recompute after a change at rest rolls back to the save made right after the last update; a
    lazy save copies the state after that update, so memory corrupted before the copy is in the
    checkpoint: such a restore must not be recomputed from."""
    model, optimizer = _updated_once()
    guard = _state_guard(2, model, optimizer)
    guard.after_update(1)  # step 2 is a check step: the state after step 1's update is hashed
    assert guard.restored_agrees(1) and guard.restored_agrees(0)  # unchanged; nothing hashed for step 0
    with torch.no_grad():
        model.weight.view(-1)[5] = model.weight.view(-1)[5] * -1.0  # one element's sign: corrupt at rest
    assert not guard.restored_agrees(1)
    assert guard.restored_agrees(0)  # another step's checkpoint: nothing to compare it with
    off = _state_guard(0, model, optimizer)
    off.after_update(1)
    assert off.restored_agrees(1)


def test_at_rest_every_step_a_restored_state_is_checked_against_the_sums_of_that_steps_update():
    """Without a replica the state is hashed (word sums) after every update, not only before a check
    step: a recompute that rolls back to a save whose lazy copy was made after memory changed must find
    that out too (it agreed by default before: nothing was kept by step)."""
    model, optimizer = _updated_once()
    guard = _state_guard(2, model, optimizer)
    assert guard.every_step
    guard.after_update(4)  # step 5 is no check step: only the every-step sums are taken
    assert guard.restored_agrees(4)
    with torch.no_grad():
        model.weight.view(-1)[5] = model.weight.view(-1)[5] * -1.0  # one element's sign: corrupt at rest
    assert not guard.restored_agrees(4)
    assert guard.restored_agrees(2)  # another step's checkpoint: nothing to compare it with


def test_at_rest_every_step_by_default_only_without_a_replica_and_a_bad_value_is_one_config_error():
    assert FingerprintConfig().every_step(1) and not FingerprintConfig().every_step(2)
    assert FingerprintConfig(at_rest="every_step").every_step(2)
    assert not FingerprintConfig(at_rest="interval").every_step(1)
    assert not FingerprintConfig(interval=0).every_step(1)  # fingerprints off: nothing hashed
    with pytest.raises(ConfigError, match="guards.fingerprint.at_rest must be one of auto, every_step, interval"):
        FingerprintConfig(at_rest="always").validate()


def test_without_a_replica_a_shard_changed_at_any_step_is_found_before_the_next_update_and_kept_unhealthy():
    """Issue 39: the at-rest comparison ran only before a check step, so a flip at any other step went
    into the next update and every later save was committed healthy. Every step now: the hash after each
    update against the shards after the next backward; an unrepaired change marks every later save."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    events = []
    guard = StateGuard(FingerprintConfig(interval=50), model, optimizer, [(0,)], 0, logging.getLogger("test"),
                       lambda kind, **fields: events.append((kind, fields)))
    assert guard.every_step
    guard.after_update(6)  # no check is due at step 7: hashed all the same
    assert not guard.changed_at_rest()
    optimizer.state[model.weight]["exp_avg"].view(-1)[3] *= -1.0  # at rest, between two updates
    assert guard.changed_at_rest()
    guard.after_change_at_rest(7)
    assert guard.recompute and guard.unrepaired is not None
    assert [(kind, f["faulty"], f["how"]) for kind, f in events] == [("fingerprint_mismatch", [0], ["at_rest"])]
    for step in (8, 10):  # no recompute replaced the state: every later save holds the corruption
        assert guard.before_save(step)["reason"] == "state changed at rest"
    # the save's own hash: memory changed between the update's hash and the save
    fresh = StateGuard(FingerprintConfig(interval=50), model, optimizer, [(0,)], 0, logging.getLogger("test"),
                       lambda *args, **kwargs: None)
    fresh.after_update(9)
    assert fresh.before_save(9) is None
    fresh.after_update(10)
    with torch.no_grad():
        model.bias.view(-1)[1] *= -1.0
    assert fresh.before_save(10)["reason"] == "state changed at rest"
    interval_only = StateGuard(FingerprintConfig(interval=50, at_rest="interval"), model, optimizer, [(0,)], 0,
                               logging.getLogger("test"), lambda *args, **kwargs: None)
    interval_only.after_update(6)
    optimizer.state[model.weight]["exp_avg"].view(-1)[4] *= -1.0
    assert not interval_only.changed_at_rest()


def adam_state_guard(interval: int, strikes: list | None = None) -> tuple[StateGuard, nn.Linear]:
    """A rank without replicas (every-step at-rest check on) after one AdamW update."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    strike = (lambda step, evidence: strikes.append((step, evidence)) or False) if strikes is not None else None
    guard = StateGuard(FingerprintConfig(interval=interval), model, optimizer, [(0,)], 0, logging.getLogger("test"),
                       lambda *args, **kwargs: None, strike=strike)
    return guard, model


def test_the_every_step_check_stays_on_after_a_skipped_step():
    """The sums were keyed by the step of their update: after a skipped step (no update, nothing
    re-hashed) no key matched until the next update, which then hashed the corrupt state as the good one."""
    guard, model = adam_state_guard(interval=50)
    guard.after_update(6)
    assert not guard.changed_at_rest()  # step 7, skipped: no after_update
    flip_bit(model.weight.detach().view(-1), 3)
    assert guard.changed_at_rest()  # step 8
    guard.after_change_at_rest(8)
    assert [m.tensor for m in guard.unrepaired.mismatches] == ["param:weight"]


def test_one_flip_found_by_the_check_of_an_interval_step_is_one_strike_not_two():
    """The replica check before the step found the flip at rest; the step's every-step comparison then
    found it again against the same sums: a second strike (and mismatch) for one flip."""
    strikes = []
    guard, model = adam_state_guard(interval=2, strikes=strikes)
    guard.after_update(1)  # step 2 is an interval step: hashed for the check and summed for every step
    flip_bit(model.weight.detach().view(-1), 3)
    verdict = guard.before_step(2)
    assert [(m.tensor, m.how) for m in verdict.mismatches] == [("param:weight", "at_rest")]
    assert not guard.changed_at_rest()  # after the backward of step 2: nothing new since the check
    assert [step for step, _ in strikes] == [2]


def test_the_every_step_flag_stays_on_the_device_until_the_steps_all_reduce(monkeypatch):
    """``.tolist()`` of the comparison was a host synchronisation every step (on a GPU, a stall of the
    stream); the flag now rides the step's all-reduce as a device tensor."""
    guard, model = adam_state_guard(interval=50)
    guard.after_update(6)
    flip_bit(model.weight.detach().view(-1), 3)

    def synchronises(*args, **kwargs):
        raise AssertionError("a host synchronisation")

    for name in ("tolist", "item", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, synchronises)
    slots = local_slots(torch.device("cpu"), None, {Slot.STATE_AT_REST: guard.changed_at_rest()})
    monkeypatch.undo()
    assert slots[Slot.STATE_AT_REST] == 1.0


def test_one_flip_found_by_the_check_before_a_save_is_one_strike_not_two():
    """The save's every-step comparison found the flip at rest; the next step's comparison then found it
    again against the same sums: a second strike for one flip."""
    strikes = []
    guard, model = adam_state_guard(interval=50, strikes=strikes)
    guard.after_update(4)
    flip_bit(model.weight.detach().view(-1), 3)
    health = guard.before_save(4)
    assert health is not None and health["reason"] == "state changed at rest"
    assert not guard.changed_at_rest()  # step 5: nothing new since the save's check
    assert [step for step, _ in strikes] == [4]
