"""A real Slurm on this machine for the tests: munged, slurmctld and eight slurmd logical nodes.

Everything lives under one directory (slurm.conf, state, spool, logs, pid files, munge's socket and
key); the daemons listen on loopback ports picked free at start and are stopped by pid. Clients find
the cluster through ``SLURM_CONF`` (see ``Cluster.env``). Debian's packages (``slurmctld``, ``slurmd``,
``slurm-client``, ``munge``) are installed by ``scripts/bootstrap.sh --with-slurm`` or, where missing
and this process is root, here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.ports import free_ports
from helpers.processes import alive

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# every long job of test_slurm.py at once (array, hang, 2 for the spare, 4 cancels): none waits for a node
# (with three, the jobs queued behind each other's time limits); the jobs mostly sleep in hang faults
NODES = tuple(f"n{i}" for i in range(1, 9))
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "scontrol")

# the timers that matter for the tests (docs/lifecycle.md explains each)
CONF_TIMERS = {
    # seconds between SIGTERM and SIGKILL when a job is cancelled or runs out of time: the ranks' save and
    # the agents' teardown must fit (up to ~20 s on a loaded 2-core machine)
    "KillWait": 60,
    "OverTimeLimit": 0,  # minutes a job may run past its limit
    "MessageTimeout": 10,
    "SlurmctldTimeout": 30,
    "SlurmdTimeout": 30,
    "InactiveLimit": 0,
    "MinJobAge": 600,  # finished jobs stay visible to scontrol for this many seconds
    "ReturnToService": 2,
}


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def install_packages() -> str | None:
    """Installs Debian's Slurm packages; None, or why it could not."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing_binaries())} missing) and apt-get as root is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    missing = missing_binaries()
    return f"still missing after install: {', '.join(missing)}" if missing else None


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class Cluster:
    root: Path
    host: str = field(default_factory=socket.gethostname)
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a Slurm client of this cluster (and of a test's processes)."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *command: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env(), capture_output=True, text=True, check=check, timeout=timeout)

    # ------------------------------------------------------------------------------------ start
    def write_conf(self, ctld_port: int, node_ports: list[int]) -> None:
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.root / sub, 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o600)
        lines = [
            "ClusterName=trainguard",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd'}.%n.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",  # no cgroups in a container: a step's processes by parentage
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/linear",  # whole nodes: one job per logical node
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            *(f"{key}={value}" for key, value in CONF_TIMERS.items()),
        ]
        for node, port in zip(NODES, node_ports):
            lines.append(f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                         "CPUs=2 RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, name: str, command: list[str], pid_file: Path) -> None:
        done = subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-1000:]}")
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                self.pids[name] = int(pid_file.read_text().split()[0])
                return
            except (OSError, ValueError, IndexError):
                time.sleep(0.1)
        raise RuntimeError(f"{name} wrote no pid file {pid_file}")

    def start(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        self.write_conf(ctld_port, node_ports)
        munge = self.root / "munge"
        self._daemon("munged", [_sbin("munged"), "--force", f"--socket={self.munge_socket}",
                                f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                                f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
                     munge / "munged.pid")
        self._daemon("slurmctld", [_sbin("slurmctld"), "-f", str(self.conf), "-i"], self.root / "slurmctld.pid")
        for node in NODES:
            self._daemon(f"slurmd-{node}", [_sbin("slurmd"), "-f", str(self.conf), "-N", node],
                         Path(f"{self.root / 'slurmd'}.{node}.pid"))
        self.wait_until_usable()

    def wait_until_usable(self, timeout: float = 90) -> None:
        deadline = time.time() + timeout
        last = ""
        while time.time() < deadline:
            done = self.run("srun", f"-N{len(NODES)}", "--immediate=10", "true", check=False, timeout=30)
            if done.returncode == 0:
                return
            last = done.stderr.strip()
            self.run("scontrol", "update", f"NodeName={','.join(NODES)}", "State=RESUME", check=False)
            time.sleep(1)
        raise RuntimeError(f"srun -N{len(NODES)} true never worked: {last}\n{self.log_tail()}")

    def log_tail(self) -> str:
        path = self.root / "log" / "slurmctld.log"
        return path.read_text()[-3000:] if path.exists() else ""

    # ------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        deadline = time.time() + CONF_TIMERS["KillWait"] + 30  # let the jobs' processes end first
        while time.time() < deadline and self.run("squeue", "--noheader", check=False).stdout.strip():
            time.sleep(1)
        for name in [*(f"slurmd-{node}" for node in NODES), "slurmctld", "munged"]:
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 10
            while time.time() < deadline and alive(pid):
                time.sleep(0.1)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    # ---------------------------------------------------------------------------------- queries
    def job_state(self, job: str) -> str:
        """STATE of a job (or array task ``JOB_TASK``) from scontrol: RUNNING, COMPLETED, CANCELLED, ..."""
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
        return fields.get("JobState", "")

    def wait_for_state(self, job: str, states: tuple[str, ...], timeout: float) -> str:
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            state = self.job_state(job)
            if state in states:
                return state
            time.sleep(1)
        raise AssertionError(f"job {job} is {state!r}, not one of {states}, after {timeout:.0f}s")

    def array_states(self, array_job: str) -> dict[str, str]:
        """Each task's state, by task id (``scontrol show job`` lists one record per task)."""
        out = self.run("scontrol", "show", "job", "-o", array_job, check=False).stdout
        states = {}
        for line in out.splitlines():
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            if "ArrayTaskId" in fields:
                states[fields["ArrayTaskId"]] = fields.get("JobState", "")
        return states


