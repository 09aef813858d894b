"""A fault drill on the reference trainer: inject faults, recover from each, prove nothing was lost.

Four ranks train HSDP (replicas across two simulated nodes, plus a spare node in the full drill) with
local and durable checkpoints and every guard on, under the supervisor, while a scripted sequence of
faults hits them. Then the last checkpoint is merged to Hugging Face format and loaded with
transformers, and a fault-free run that replays the faulty run's skip decisions (read from its
events) must end with bitwise the same parameters and optimizer state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.events import read_events
from trainguard.merge.read_ranks import flatten
from trainguard.report import REPORT_FILE
from trainguard.runtime.heartbeat import read_heartbeats

NORM_SITE = "model.layers.0.input_layernorm"


@dataclass(frozen=True)
class Fault:
    spec: str  # TRAINGUARD_FAULTS entry; empty for the kill switch, which the drill sets itself
    what: str  # the fault in words


@dataclass(frozen=True)
class DrillPlan:
    nproc: int  # ranks per node
    nnodes: int
    spare_nodes: int
    steps: int  # the schedule's length; the kill switch stops the run before
    save_interval: int
    local_interval: int
    kill_switch_at: int  # the drill arms the kill switch once a rank has completed this step
    faults: tuple[Fault, ...]
    preset: str
    hang_timeout: float = 8.0
    max_restarts: int = 6


def plan(quick: bool) -> DrillPlan:
    if quick:
        faults = (
            Fault("spike:step=4", "gradient spike ×10⁴"),
            Fault("wipe:node=1,step=6", "node 1's local checkpoint directory deleted"),
            Fault("kill:rank=3,step=8", "SIGKILL of rank 3"),
            Fault(f"bitflip:rank=0,step=11,site={NORM_SITE},where=grad_input,bit=exp", "transient bit flip"),
            Fault("", "kill switch"),
        )
        return DrillPlan(nproc=2, nnodes=2, spare_nodes=0, steps=40, save_interval=4, local_interval=3,
                         kill_switch_at=14, faults=faults, preset="llama-micro")
    faults = (
        Fault("spike:step=5", "gradient spike ×10⁴"),
        Fault("spike:step=9", "gradient spike ×10⁴"),
        Fault("wipe:node=1,step=10", "node 1's local checkpoint directory deleted"),
        Fault("kill:rank=3,step=12", "SIGKILL of rank 3"),
        Fault(f"bitflip:rank=0,step=16,site={NORM_SITE},where=grad_input,bit=exp", "transient bit flip"),
        Fault("corrupt:step=24,file=__0_0.distcp", "durable checkpoint 24 corrupted"),
        Fault("hang:rank=1,step=27", "rank 1 hangs"),
        Fault(f"bitflip:rank=2,node=node1,step=32,site={NORM_SITE},where=grad_input,bit=exp,persistent=1",
              "persistent bit flip on node 1"),
        Fault("", "kill switch"),
    )
    return DrillPlan(nproc=2, nnodes=2, spare_nodes=1, steps=80, save_interval=4, local_interval=5,
                     kill_switch_at=40, faults=faults, preset="llama-micro")


def _fault_text(p: DrillPlan) -> str:
    return ";".join(f.spec for f in p.faults if f.spec)


def _train_command(run_dir: Path, p: DrillPlan, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainguard", "train", "--nproc", str(p.nproc), "--nnodes", str(p.nnodes),
            "--steps", str(p.steps), "--save-interval", str(p.save_interval), "--run-dir", str(run_dir),
            "--set", f"model.preset={p.preset}", "--set", "data.seq_len=64", "--set", "data.micro_batch_size=2",
            "--set", "parallel.dp_replicate=2", "--set", f"parallel.ranks_per_node={p.nproc}",
            "--set", f"checkpoint.local_interval={p.local_interval}",
            "--set", "guards.skip.enabled=true", "--set", "guards.skip.threshold=1000",
            "--set", "guards.health.enabled=true", "--set", "guards.health.embedding_threshold=1000",
            "--set", "guards.sdc.enabled_level=2",
            # synchronous saves make the script deterministic: a checkpoint is committed before the next
            # step, so each fault lands after a known commit (async saves are drilled in the tests)
            "--set", "checkpoint.async_save=false", *extra]


def _env(faults: str | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRAINGUARD_FAULTS", None)
    if faults:
        env["TRAINGUARD_FAULTS"] = faults
    return env


def last_failure(run_dir: Path) -> str:
    """``": <what ended the run's last incarnation>"`` (the supervisor's attribution, with the error that
    ended a rank where there was one), or "" when the run recorded none."""
    try:
        ended = list(read_events(run_dir / "events.jsonl", "incarnation_ended"))
    except OSError:
        return ""
    detail = ended[-1].get("detail") if ended else None
    return f": {escape(detail)}" if detail else ""  # "[Errno 2]" is not markup


def _highest_step(run_dir: Path) -> int:
    return max((beat.step or 0 for beat in read_heartbeats(run_dir).values()), default=0)


def _run_faulty(run_dir: Path, p: DrillPlan, log, status) -> int:
    kill_switch = run_dir / "KILL_SWITCH"
    doctor = ("--doctor",) if p.spare_nodes else ()  # a spare passes trainguard doctor before it joins
    command = _train_command(run_dir, p, "--spare-nodes", str(p.spare_nodes), *doctor,
                             "--max-restarts", str(p.max_restarts), "--hang-timeout", str(p.hang_timeout),
                             "--set", f"lifecycle.kill_switch_path={kill_switch}")
    proc = subprocess.Popen(command, env=_env(_fault_text(p)), stdout=log, stderr=subprocess.STDOUT)
    events_path = run_dir / "events.jsonl"
    while proc.poll() is None:
        time.sleep(0.2)
        step = _highest_step(run_dir)
        if step >= p.kill_switch_at and not kill_switch.exists():
            kill_switch.touch()
        restarts = sum(1 for e in read_events(events_path) if e["kind"] == "restart") if events_path.exists() else 0
        status.update(f"faulty run: step {step}, restarts {restarts}"
                      + (", kill switch armed" if kill_switch.exists() else ""))
    return proc.returncode


def _final_timeline_skips(events: list[dict]) -> tuple[list[int], int]:
    """The steps the faulty run did not apply on its final timeline, and the step it stopped at.

    A step redone after a restart counts as its last attempt; a step ended by a faulty-device verdict
    (exit 17) was saved without its update and never redone.
    """
    last_attempt: dict[int, bool] = {}
    for event in events:
        if event["kind"] == "step":
            last_attempt[event["step"]] = bool(event.get("skipped"))
        elif event["kind"] == "sdc_rerun" and event.get("verdict") == "faulty":
            last_attempt[event["step"]] = True
    stops = [e for e in events if e["kind"] == "lifecycle_stop"]
    final = stops[-1]["step"] if stops else max(last_attempt, default=0)
    return sorted(s for s, skipped in last_attempt.items() if skipped and s <= final), final


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {key: value for key, value in flatten(state).items() if isinstance(value, torch.Tensor)}


def _identical(a: Path, b: Path) -> bool:
    ta, tb = _tensors(read_full_state_dict(a)), _tensors(read_full_state_dict(b))
    return bool(ta) and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _merge_and_load(checkpoint: Path, target: Path) -> str:
    """Merges the checkpoint to Hugging Face format, loads it with transformers and checks every weight."""
    from transformers import AutoModelForCausalLM

    from trainguard.merge.merger import merge_to_hf

    merge_to_hf(checkpoint, target, backend="dcp", force=True)
    model = AutoModelForCausalLM.from_pretrained(target)
    saved = {k.removeprefix("model."): v for k, v in _tensors(read_full_state_dict(checkpoint)).items()
             if k.startswith("model.")}
    loaded = model.state_dict()
    same = all(torch.equal(loaded[name], saved[name]) for name in loaded if name in saved)
    if not same or not saved.keys() <= loaded.keys() | {k for k in saved if "rotary" in k}:
        return "merged, but the loaded weights differ from the checkpoint"
    return f"merged to {target.name}/ and loaded with transformers: {len(loaded)} tensors equal the checkpoint's"


@dataclass
class Outcome:
    fault: Fault
    step: int | str
    detected: str
    handled: str
    recover: str
    redone: str
    ok: bool


def _recoveries(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "recovered"]


def judge_outcomes(p: DrillPlan, events: list[dict], final_step: int) -> list[Outcome]:
    injected: dict[int, dict] = {}
    for event in events:
        if event["kind"] == "fault_injected":
            injected.setdefault(event["fault_index"], event)
    recoveries = _recoveries(events)
    restarts = [e for e in events if e["kind"] == "restart"]
    outcomes = []
    index = 0
    for fault in p.faults:
        if not fault.spec:
            stops = [e for e in events if e["kind"] == "lifecycle_stop"]
            ok = bool(stops) and stops[-1].get("reason") == "kill_switch"
            outcomes.append(Outcome(fault, final_step, "kill switch file found before a step",
                                    f"checkpoint at step {final_step}, exit 0" if ok else "not stopped by it",
                                    "—", "—", ok))
            continue
        event = injected.get(index)
        index += 1
        kind = fault.spec.split(":")[0]
        if event is None:
            outcomes.append(Outcome(fault, "—", "never injected", "—", "—", "—", False))
            continue
        step = event["step"]
        after = [e for e in events if e["time"] > event["time"]]
        recovery = next((r for r in recoveries if r["time"] > event["time"]), None)
        recover = f"{recovery['seconds']:.1f} s" if recovery else "—"
        redone = str(recovery.get("steps_redone", "—")) if recovery else "0"
        if kind == "spike":
            skips = [e for e in after if e["kind"] == "data_skip" and e["step"] == step]
            outcomes.append(Outcome(fault, step, f"global norm {skips[0]['global_norm']:.3g} > threshold"
                                    if skips else "not detected", "step skipped" if skips else "applied",
                                    "—", "0", bool(skips)))
        elif kind == "kill":
            restart = next((r for r in restarts if r["time"] > event["time"]), None)
            ok = restart is not None and recovery is not None
            # the restart's exit_code is the incarnation's (its agents': 1), not the killed rank's;
            # its detail names the rank and how it ended ("rank 3 on node1 failed (signal SIGKILL)")
            outcomes.append(Outcome(fault, step, (restart.get("detail") or f"rank {restart.get('failing_rank')} failed")
                                    if restart else "not detected",
                                    f"restarted, resumed at step {recovery['step']}" if ok else "not recovered",
                                    recover, redone, ok))
        elif kind == "wipe":
            recovered = [e for e in after if e["kind"] == "local_recovery" and e.get("step") is not None
                         and e.get("ranks")]
            ok = bool(recovered)
            how = (f"ranks {recovered[0]['ranks']} got step {recovered[0]['step']} from their replicas "
                   f"({recovered[0]['bytes'] / 1e6:.1f} MB over gloo)") if ok else "not recovered from replicas"
            outcomes.append(Outcome(fault, step, "files missing at the next resume" if ok else "—", how,
                                    f"{recovered[0]['seconds']:.2f} s" if ok else "—", "—", ok))
        elif kind == "bitflip" and "persistent=1" not in fault.spec:
            reruns = [e for e in after if e["kind"] == "sdc_rerun" and e["step"] == step]
            ok = bool(reruns) and reruns[0]["verdict"] == "transient"
            outcomes.append(Outcome(fault, step, "SDC level 1 at a norm layer's input gradient" if reruns
                                    else "not detected", "rerun differed: transient, clean rerun used" if ok
                                    else "not handled", "—", "0", ok))
        elif kind == "bitflip":
            excluded = [e for e in after if e["kind"] == "node_excluded"]
            spares = [e for e in after if e["kind"] == "spare_started"]
            ok = bool(excluded and spares and recovery)
            checked = any(e["kind"] == "doctor_passed" for e in after)
            outcomes.append(Outcome(fault, step, "SDC strikes on the same rank → exit 17" if excluded
                                    else "not detected", f"node {excluded[0]['node']} excluded, spare "
                                    f"{spares[0]['node']} {'self-tested and ' if checked else ''}started"
                                    if ok else "not handled", recover, redone, ok))
        elif kind == "corrupt":
            starts = [e for e in after if e["kind"] == "run_started" and e.get("resumed_from")]
            passed = [s for s in starts if not s["resumed_from"].endswith(f"global_step_{step}")]
            ok = bool(passed) and len(passed) == len(starts)
            outcomes.append(Outcome(fault, step, "checksum mismatch at resume" if ok else "—",
                                    f"passed over, resumed from {Path(passed[0]['resumed_from']).name}" if ok
                                    else "never needed at resume", "—", "—", ok))
        elif kind == "hang":
            hangs = [e for e in after if e["kind"] == "hang_detected"]
            ok = bool(hangs) and recovery is not None
            outcomes.append(Outcome(fault, step, f"no progress for the hang timeout; stacks in {hangs[0]['dumps']}"
                                    if hangs else "not detected", "group killed, restarted" if ok else
                                    "not recovered", recover, redone, ok))
    return outcomes


def run_drill(out: Path, quick: bool, console: Console | None = None) -> int:
    console = console or Console()
    p = plan(quick)
    out.mkdir(parents=True, exist_ok=True)
    faulty, reference = out / "faulty", out / "reference"
    log_path = out / "drill.log"
    started = time.monotonic()
    console.print(f"[bold]trainguard fault drill[/] → {out} (log: {log_path})")
    console.print(f"{p.nnodes} nodes × {p.nproc} ranks (HSDP, replicas across nodes), {p.spare_nodes} spare; "
                  f"faults: {_fault_text(p)}; kill switch after step {p.kill_switch_at}")
    with open(log_path, "a") as log, console.status("starting the faulty run") as status:
        code = _run_faulty(faulty, p, log, status)
        if code != 0:
            console.print(f"[red]drill failed: the faulty run ended with exit {code}{last_failure(faulty)} "
                          f"(see {log_path})[/]", highlight=False)
            return 1
        events = list(read_events(faulty / "events.jsonl"))
        skips, final_step = _final_timeline_skips(events)
        status.update(f"fault-free reference to step {final_step}, replaying skips {skips}")
        reference_code = subprocess.run(
            _train_command(reference, p, "--set", f"train.exit_at_step={final_step}",
                           "--set", f"guards.skip.replay_steps=[{','.join(map(str, skips))}]"),
            env=_env(None), stdout=log, stderr=subprocess.STDOUT).returncode
        if reference_code != 0:
            console.print(f"[red]drill failed: the reference run ended with exit {reference_code}"
                          f"{last_failure(reference)} (see {log_path})[/]", highlight=False)
            return 1
        status.update("merging the last checkpoint to Hugging Face format")
        checkpoint = faulty / "checkpoints" / f"global_step_{final_step}"
        merged = _merge_and_load(checkpoint, out / "hf")
        status.update("writing the report")
        report_code = subprocess.run([sys.executable, "-m", "trainguard", "report", str(faulty)], stdout=log,
                                     stderr=subprocess.STDOUT, env=_env(None)).returncode

    outcomes = judge_outcomes(p, events, final_step)
    table = Table(title="fault drill")
    for column in ("fault", "step", "how it was detected", "how it was handled", "time to recover", "steps redone"):
        table.add_column(column)
    for o in outcomes:
        table.add_row(o.fault.what, str(o.step), o.detected, o.handled, o.recover, o.redone,
                      style=None if o.ok else "red")
    console.print(table)
    console.print(merged)
    report = DrillReport(faulty / REPORT_FILE, report_code, log_path)
    console.print(f"{report.line()}; total {time.monotonic() - started:.0f} s")
    identical = _identical(checkpoint, reference / "checkpoints" / f"global_step_{final_step}")
    passed, verdict = drill_verdict(outcomes, identical, merged, report)
    console.print(verdict if passed else f"[red]{verdict}[/]")
    return 0 if passed else 1


@dataclass(frozen=True)
class DrillReport:
    """What ``trainguard report`` left: its path is shown only when it wrote it."""

    path: Path
    exit_code: int
    log_path: Path

    @property
    def written(self) -> bool:
        return self.exit_code == 0 and self.path.is_file()

    def line(self) -> str:
        if self.written:
            return f"report: {self.path}"
        return f"report: not written (trainguard report exited {self.exit_code}; see {self.log_path})"


def drill_verdict(outcomes: list[Outcome], identical: bool, merged: str, report: DrillReport) -> tuple[bool, str]:
    """(passed, the drill's last line): it passes only when every fault was handled, the final parameters
    equal the fault-free run's, the merge loaded and the report was written."""
    handled, total = sum(o.ok for o in outcomes), len(outcomes)
    if handled == total and identical and merged.startswith("merged to") and report.written:
        return True, f"drill passed: {handled}/{total} faults handled, final parameters identical to the fault-free run"
    report_failure = "" if report.written else "; report not written"
    return False, (f"drill failed: {handled}/{total} faults handled, final parameters "
                   f"{'identical' if identical else 'DIFFERENT'}; {merged}{report_failure}")
