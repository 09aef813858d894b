"""A fault drill on the reference trainer: inject faults, recover from each, prove nothing was lost.

The faulty run is restarted after every crash (resuming from the newest checkpoint that verifies);
a fault-free run of the same configuration is the reference its final parameters must equal bitwise.
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
from rich.table import Table

from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.events import read_events


@dataclass(frozen=True)
class DrillPlan:
    nproc: int
    steps: int
    save_interval: int
    faults: str
    train_args: tuple[str, ...]
    max_restarts: int = 5


def plan(quick: bool) -> DrillPlan:
    steps = 16 if quick else 32
    faults = ";".join([
        f"kill:rank=1,step={steps // 4 + 3}",          # a rank dies mid-run
        f"corrupt:step={steps // 2},file=__0_0.distcp",  # a committed checkpoint rots on disk
        f"kill:rank=0,step={steps // 2 + 3}",          # ...and the next crash must not resume from it
        f"bitflip:rank=1,step={steps - 2},site=model.layers.1.input_layernorm,where=grad_input,bit=exp",
    ])
    preset = "llama-micro" if quick else "llama-tiny"
    return DrillPlan(
        nproc=2, steps=steps, save_interval=4, faults=faults,
        train_args=("--set", f"model.preset={preset}", "--set", "data.seq_len=64", "--set", "data.micro_batch_size=2",
                    "--set", "guards.sdc.enabled_level=2",
                    # synchronous saves make the script deterministic: a checkpoint is committed before the
                    # next step, so each kill lands after a known commit (async saves are drilled in tests)
                    "--set", "checkpoint.async_save=false"),
    )


def _train(run_dir: Path, p: DrillPlan, faults: str | None, log) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRAINGUARD_FAULTS", None)
    if faults:
        env["TRAINGUARD_FAULTS"] = faults
    cmd = [sys.executable, "-m", "trainguard", "train", "--nproc", str(p.nproc), "--steps", str(p.steps),
           "--save-interval", str(p.save_interval), "--run-dir", str(run_dir), *p.train_args]
    return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def _final_state(run_dir: Path, step: int) -> dict:
    return read_full_state_dict(run_dir / "checkpoints" / f"global_step_{step}")


def _identical(a: dict, b: dict) -> bool:
    def tensors(d: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out.update(tensors(value, f"{prefix}{key}."))
            elif isinstance(value, torch.Tensor):
                out[prefix + key] = value
        return out

    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def run_drill(out: Path, quick: bool, console: Console | None = None) -> int:
    console = console or Console()
    p = plan(quick)
    out.mkdir(parents=True, exist_ok=True)
    faulty, reference = out / "faulty", out / "reference"
    log_path = out / "drill.log"
    console.print(f"[bold]trainguard fault drill[/] → {out} (log: {log_path})")
    console.print(f"faults: {p.faults}")
    incidents = []
    with open(log_path, "a") as log, console.status("running the faulty run") as status:
        restarts = 0
        while True:
            started = time.monotonic()
            code = _train(faulty, p, p.faults, log)
            if code == 0:
                break
            restarts += 1
            incidents.append((code, time.monotonic() - started))
            if restarts > p.max_restarts:
                console.print(f"[red]drill failed: the run did not finish after {p.max_restarts} restarts[/]")
                return 1
            status.update(f"faulty run crashed (exit {code}); restart {restarts}")
        status.update("running the fault-free reference")
        if _train(reference, p, None, log) != 0:
            console.print(f"[red]drill failed: the reference run crashed (see {log_path})[/]")
            return 1

    events = list(read_events(faulty / "events.jsonl"))
    injected = [e for e in events if e["kind"] == "fault_injected"]
    starts = [e for e in events if e["kind"] == "run_started"]
    table = Table(title="faults")
    for column in ("fault", "step", "rank", "how it was handled"):
        table.add_column(column)
    handled = 0
    for fault in injected:
        if fault["fault"] == "kill":
            after = [s for s in starts if s["time"] > fault["time"]]
            if not after:
                how = "not recovered"
            elif after[0]["resumed_from"]:
                how = f"restarted, resumed from {Path(after[0]['resumed_from']).name}"
            else:
                how = "restarted from scratch (no checkpoint committed yet)"
            handled += bool(after)
        elif fault["fault"] == "bitflip":
            reruns = [e for e in events if e["kind"] == "sdc_attribution" and e["step"] == fault["step"]]
            handled += bool(reruns) and reruns[0]["attribution"] == "transient"
            how = "detected, rerun, transient: the clean rerun was used" if reruns else "not detected"
        else:
            skipped = [s for s in starts if s["time"] > fault["time"] and s["resumed_from"]
                       and not s["resumed_from"].endswith(f"global_step_{fault['step']}")]
            how = "failed verification, passed over at resume" if skipped else "never needed at resume"
            handled += bool(skipped)
        table.add_row(fault["fault"], str(fault["step"]), str(fault["rank"]), how)
    console.print(table)
    identical = _identical(_final_state(faulty, p.steps), _final_state(reference, p.steps))
    total = len(p.faults.split(";"))
    if handled == total and len(injected) == total and identical:
        console.print(f"drill passed: {handled}/{total} faults handled, final parameters identical to the fault-free run")
        return 0
    console.print(f"[red]drill failed: {handled}/{total} faults handled, "
                  f"final parameters {'identical' if identical else 'DIFFERENT'}[/]")
    return 1
