"""The precedence of the step's guard verdicts (``guards/step_verdict.decide``): which plugins are asked, in which
order, and which verdict the step acts on, as pure logic on scripted plugins."""

from __future__ import annotations

import pytest

from trainguard.guards.step_verdict import Decision, StepVerdict, decide

APPLY, SKIP, RERUN, ROLLBACK, ABORT = (StepVerdict.APPLY, StepVerdict.SKIP, StepVerdict.RERUN, StepVerdict.ROLLBACK,
                                       StepVerdict.ABORT)


class Scripted:
    """A plugin that answers a fixed verdict, and after its rerun or rollback a second one."""

    def __init__(self, name: str, answer: StepVerdict, after: StepVerdict | None = None, watches: bool = False):
        self.name, self.answer, self.after, self.watches_every_step = name, answer, after, watches

    def __repr__(self) -> str:
        return self.name


def run(plugins: list[Scripted], decided: Decision | None = None) -> tuple[Decision, list[str]]:
    asked: list[str] = []

    def ask(plugin: Scripted, so_far: StepVerdict) -> StepVerdict:
        asked.append(f"{plugin.name}@{so_far.name}")
        return plugin.answer

    def carry_out(plugin: Scripted, verdict: StepVerdict) -> StepVerdict:
        asked.append(f"{plugin.name}:{verdict.name}")
        return plugin.after

    return decide(plugins, ask, carry_out, decided), asked


def test_the_verdicts_are_ordered_by_strength():
    assert APPLY < SKIP < RERUN < ROLLBACK < ABORT
    assert [v.name for v in StepVerdict] == ["APPLY", "SKIP", "RERUN", "ROLLBACK", "ABORT"]


def test_nothing_objects_the_step_applies():
    decision, asked = run([Scripted("a", APPLY), Scripted("b", APPLY)])
    assert decision == Decision(APPLY, None) and asked == ["a@APPLY", "b@APPLY"]


def test_the_first_skip_stands_and_later_guards_are_not_asked_but_the_streak_is():
    skip, rollback, streak = Scripted("skip", SKIP), Scripted("rollback", ROLLBACK), Scripted("streak", APPLY,
                                                                                             watches=True)
    decision, asked = run([skip, rollback, streak])
    assert decision == Decision(SKIP, skip)
    assert asked == ["skip@APPLY", "streak@SKIP"]  # rollback mode never judges a skipped step


def test_abort_wins_over_a_skip_decided_before_it():
    skip, streak = Scripted("skip", SKIP), Scripted("streak", ABORT, watches=True)
    assert run([skip, streak])[0] == Decision(ABORT, streak)


def test_an_abort_ends_the_step_at_once():
    abort, streak = Scripted("data skip", ABORT), Scripted("streak", ABORT, watches=True)
    decision, asked = run([abort, Scripted("nonfinite", SKIP), streak])
    assert decision == Decision(ABORT, abort) and asked == ["data skip@APPLY"]


def test_a_rerun_is_carried_out_before_the_next_guard_is_asked_and_its_verdict_stands():
    sdc, skip, streak = Scripted("sdc", RERUN, after=SKIP), Scripted("skip", SKIP), Scripted("streak", APPLY,
                                                                                            watches=True)
    decision, asked = run([sdc, skip, streak])
    assert decision == Decision(SKIP, sdc)
    assert asked == ["sdc@APPLY", "sdc:RERUN", "streak@SKIP"]  # a reproduced detection: the data skip is not asked
    transient = Scripted("sdc", RERUN, after=APPLY)
    decision, asked = run([transient, skip])
    assert decision == Decision(SKIP, skip) and asked == ["sdc@APPLY", "sdc:RERUN", "skip@APPLY"]
    faulty = Scripted("sdc", RERUN, after=ABORT)
    assert run([faulty, skip, streak]) == (Decision(ABORT, faulty), ["sdc@APPLY", "sdc:RERUN"])


def test_a_second_rerun_of_one_step_is_refused():
    with pytest.raises(ValueError, match="asked for a second rerun"):
        run([Scripted("sdc", RERUN, after=RERUN)])


def test_a_rollback_carried_out_ends_the_step_and_one_with_nothing_to_restore_goes_on():
    restored, streak = Scripted("state", ROLLBACK, after=ROLLBACK), Scripted("streak", APPLY, watches=True)
    assert run([restored, Scripted("sdc", RERUN), streak]) == (Decision(ROLLBACK, restored),
                                                                ["state@APPLY", "state:ROLLBACK"])
    nothing, sdc = Scripted("state", ROLLBACK, after=APPLY), Scripted("sdc", APPLY)
    assert run([nothing, sdc]) == (Decision(APPLY, None), ["state@APPLY", "state:ROLLBACK", "sdc@APPLY"])
    spike = Scripted("rollback", ROLLBACK, after=ABORT)  # recurred too often, or nothing before the spike
    assert run([spike, streak]) == (Decision(ABORT, spike), ["rollback@APPLY", "rollback:ROLLBACK"])


def test_a_phase_goes_on_from_the_decision_of_the_phase_before():
    sdc, skip, streak = Scripted("sdc", SKIP), Scripted("skip", SKIP), Scripted("streak", APPLY, watches=True)
    decision, asked = run([skip, streak], decided=Decision(SKIP, sdc))
    assert decision == Decision(SKIP, sdc) and asked == ["streak@SKIP"]
    assert run([skip, streak], decided=Decision(ABORT, sdc)) == (Decision(ABORT, sdc), [])
