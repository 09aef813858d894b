"""Live runs of tests/integration/live_fsdp_loop.py (FSDP2 inside each of 2 replica groups of 2 ranks), started
without waiting, so that a module's independent runs share the machine's waits, and the fault-free run that
test_live_fsdp.py and test_live_fsdp_sdc.py both compare with is made once per session."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from helpers.runs import finish_session, worker_env
from helpers.warm_command import warm_server

SCRIPT = Path(__file__).resolve().parents[1] / "integration" / "live_fsdp_loop.py"
WORLD, STEPS = 4, 8
TIMEOUT_S = 300
# the fault-free run's configuration; the runs compared with it change it by --set or by text added below it.
# The heartbeat timeout is long: several 4-rank runs started together on a small machine can be silent for
# longer than the default 10 s (no run compared with it drills a hang; a killed rank is seen by its exit)
CLEAN = """fault_tolerance: {live: true, fsdp: true, hang_s: 60}
parallel: {dp_replicate: 2, dp_shard: 2}
train: {micro_batches: 8, steps: %d}
checkpoint: {save_interval: 4}
guards: {fingerprint: {interval: 2}}
""" % STEPS


def start_live_fsdp(config: Path, run_dir: Path, *overrides: str, script: tuple[str, ...] = ()) -> subprocess.Popen:
    """``trainguard run --nproc 4 --config CONFIG`` of the loop, ``--set`` each override, the loop's own flags
    ``script``; started, not waited for."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    return warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir),
                                *sets, "--", sys.executable, str(SCRIPT), "--steps", str(STEPS), "--config",
                                str(config), *script], worker_env())


@dataclass
class StartedRun:
    """A run started once and waited for by whichever test reads it first; a failed run fails every reader."""

    run_dir: Path
    proc: subprocess.Popen
    what: str
    done: list[subprocess.CompletedProcess] = field(default_factory=list)

    def wait(self) -> subprocess.CompletedProcess:
        if not self.done:
            self.done.append(finish_session(self.proc, TIMEOUT_S, self.what))
        return self.done[0]

    def finished(self) -> Path:
        result = self.wait()
        assert result.returncode == 0, f"{self.what}: exit {result.returncode}\n{result.stdout[-3000:]}" \
                                       f"\n{result.stderr[-3000:]}"
        return self.run_dir


def start_clean(root: Path) -> StartedRun:
    config = root / "clean.yaml"
    config.write_text(CLEAN, encoding="utf-8")
    return StartedRun(root / "clean", start_live_fsdp(config, root / "clean"), "the fault-free live FSDP2 run")
