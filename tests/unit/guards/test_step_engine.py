"""The step sequence both modes run (``guards/step_engine.run_step``): which hooks of a mode's engine are
called, in which order, for each way a step ends, on a scripted engine; and the update both modes apply
(``apply_update``: clip by the global norm, the optimizer, then what follows it) on a real optimizer."""

from __future__ import annotations

import pytest
import torch

from trainguard.guards.step_engine import apply_update, run_step, update_lr
from trainguard.guards.step_verdict import Decision, StepVerdict

APPLY, SKIP, ROLLBACK, ABORT = StepVerdict.APPLY, StepVerdict.SKIP, StepVerdict.ROLLBACK, StepVerdict.ABORT


class Scripted:
    """An engine whose hooks record their call and answer what the test set."""

    def __init__(self, begin=APPLY, computed=None, integrity=APPLY, update=APPLY):
        self.answers = {"begin": begin, "integrity": integrity, "update": update}
        self.computed = computed
        self.calls: list[str] = []

    def begin(self) -> Decision:
        self.calls.append("begin")
        return Decision(self.answers["begin"], None)

    def compute(self):
        self.calls.append("compute")
        return self.computed

    def integrity(self) -> Decision:
        self.calls.append("integrity")
        return Decision(self.answers["integrity"], None)

    def gradient_judged(self) -> None:
        self.calls.append("gradient_judged")

    def update(self, decided: Decision) -> Decision:
        self.calls.append(f"update@{decided.verdict.name}")
        return Decision(max(self.answers["update"], decided.verdict), None)

    def end_early(self, decision: Decision) -> str:
        self.calls.append(f"end_early@{decision.verdict.name}")
        return "ended"

    def apply(self) -> None:
        self.calls.append("apply")

    def commit(self, skipped: bool) -> str:
        self.calls.append(f"commit@{'skipped' if skipped else 'applied'}")
        return "committed"


STEP = ["begin", "compute", "integrity", "gradient_judged"]


@pytest.mark.parametrize("engine, outcome, calls", [
    (Scripted(), "committed", STEP + ["update@APPLY", "apply", "commit@applied"]),
    (Scripted(update=SKIP), "committed", STEP + ["update@APPLY", "commit@skipped"]),
    # an integrity SKIP (an SDC detection that came back) is what the update's plugins go on from
    (Scripted(integrity=SKIP), "committed", STEP + ["update@SKIP", "commit@skipped"]),
    (Scripted(begin=ROLLBACK), "ended", ["begin", "end_early@ROLLBACK"]),
    (Scripted(begin=ABORT), "ended", ["begin", "end_early@ABORT"]),
    (Scripted(computed=False), False, ["begin", "compute"]),  # live mode: a rank's computation raised
    (Scripted(integrity=ABORT), "ended", ["begin", "compute", "integrity", "end_early@ABORT"]),
    (Scripted(update=ROLLBACK), "ended", STEP + ["update@APPLY", "end_early@ROLLBACK"]),
    (Scripted(update=ABORT), "ended", STEP + ["update@APPLY", "end_early@ABORT"]),
], ids=["apply", "skip", "integrity-skip", "begin-rollback", "begin-abort", "not-computed", "integrity-abort",
        "update-rollback", "update-abort"])
def test_each_way_a_step_ends_calls_the_hooks_in_the_one_order(engine, outcome, calls):
    assert run_step(engine) == outcome
    assert engine.calls == calls


def test_the_update_clips_by_the_global_norm_then_steps_the_optimizer_then_the_scheduler():
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])  # norm 5
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    seen = []
    apply_update([weight.grad], 1.0, 5.0, optimizer, lambda: seen.append((weight.detach().clone(), scheduler.step())))
    moved = seen[0][0]
    assert torch.allclose(moved, torch.tensor([-0.6, -0.8]), atol=1e-5)  # clipped to norm 1, then one SGD step
    assert update_lr(optimizer, scheduler) == 0.5  # the scheduler stepped after the optimizer
    assert update_lr(torch.optim.SGD([weight], lr=0.25), None) == 0.25


def test_no_clip_when_grad_clip_is_off():
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    optimizer = torch.optim.SGD([weight], lr=1.0)
    apply_update([weight.grad], 0.0, 5.0, optimizer, lambda: None)
    assert torch.equal(weight.detach(), torch.tensor([-3.0, -4.0]))
