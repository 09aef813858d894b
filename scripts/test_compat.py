#!/usr/bin/env python3
"""``make test-compat``: trainguard under each torch version of a list, and checkpoints across them.

For each version a cached virtual environment ``.venv-compat/torch-<version>/`` holds that torch and the
same third-party packages as ``.venv`` (``pip freeze`` of it: only torch differs), trainguard installed
editable from this tree. A CUDA build of torch (all of PyPI's Linux wheels before 2.13) needs its
``nvidia-*`` libraries just to import, even on a CPU: each pinned one is installed once, under
``.venv-compat/cuda/<name>-<version>/``, and the environments that need it list it in a ``.pth`` file.
Wheels are downloaded once into ``.venv-compat/wheels/``.

Then, per version: ``trainguard demo --quick``, the unit tests, and a two-rank FSDP2 run with both
tiers (durable checkpoints at steps 4 and 6, local ones at 3 and 6). Per ordered pair of versions
(A wrote, B loads), under B: ``trainguard ckpt verify`` of A's durable checkpoints, a resume from A's
durable step 6 (its local tier removed), and a resume from A's local step 6 (its durable step 6
removed): the local step loads, or is refused in one line naming both versions and the run resumes
from the durable step 4. Prints the results table (markdown) and writes it, with the raw results as
JSON, to ``--out``. Not run by CI: each older torch is a download of several GB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / ".venv-compat"
WHEELS = COMPAT / "wheels"
CUDA = COMPAT / "cuda"
REFERENCE_VENV = ROOT / ".venv"
DEFAULT_VERSIONS = ("2.8.0", "2.13.0", "2.14.1")  # the declared floor, the pinned one, the newest tested
TRAIN = ("--nproc", "2", "--save-interval", "4", "--set", "model.preset=llama-micro", "--set", "data.seq_len=32",
         "--set", "data.micro_batch_size=2", "--set", "checkpoint.local_interval=3")
WRITTEN_STEPS, RESUMED_STEPS = 6, 8
# pip's configuration on some machines caps torch (a constraints file); the versions asked for here are meant
PIP_ENV = {"PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@dataclass
class VersionResult:
    version: str
    demo: str = "not run"
    unit: str = "not run"
    written: str = "not run"
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadResult:
    writer: str
    reader: str
    verify: str = "not run"
    durable: str = "not run"
    local: str = "not run"


def run(command: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 1800,
        log: Path | None = None) -> subprocess.CompletedProcess:
    # a fault drill exported in the developer's shell must not reach the checks
    full_env = {key: value for key, value in os.environ.items() if key != "TRAINGUARD_FAULTS"} | (env or {})
    proc = subprocess.run(command, env=full_env, cwd=cwd, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(command)}\n{proc.stdout}")
    return proc


def checked(command: list[str], **kwargs) -> str:
    proc = run(command, **kwargs)
    if proc.returncode:
        sys.exit(f"test_compat: {' '.join(command)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.stdout


# ------------------------------------------------------------------------------------- environments
def third_party_requirements() -> list[str]:
    """``.venv``'s packages, pinned, less torch, its CUDA libraries and trainguard itself."""
    if not (REFERENCE_VENV / "bin" / "python").exists():
        sys.exit("test_compat: .venv is missing: run `make bootstrap` first (its packages are the reference)")
    frozen = checked([str(REFERENCE_VENV / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
                     env=PIP_ENV)
    skipped = ("torch==", "torch @", "nvidia-", "triton", "cuda-", "trainguard")
    return sorted(line for line in frozen.splitlines()
                  if line and not line.startswith(("-e", "#")) and not line.lower().startswith(skipped))


def torch_wheel(version: str) -> Path:
    """The wheel of ``version`` in the cache, downloaded first when missing."""
    def cached() -> list[Path]:
        return sorted(WHEELS.glob(f"torch-{version}-*.whl")) + sorted(WHEELS.glob(f"torch-{version}+cpu-*.whl"))

    if not cached():
        WHEELS.mkdir(parents=True, exist_ok=True)
        print(f"downloading torch {version} (a CUDA build is about 1 GB)", flush=True)
        checked([sys.executable, "-m", "pip", "download", "--no-deps", f"torch=={version}", "-d", str(WHEELS)],
                env=PIP_ENV)
    # the CPU build where the machine has it (local wheels), else PyPI's
    return next((w for w in cached() if "+cpu" in w.name), cached()[0])


CUDA_INSTALL = threading.Lock()  # environments made side by side share the libraries they pin alike


def cuda_requirements(python: Path) -> list[str]:
    """The CUDA libraries the installed torch requires: ``nvidia-*`` pins (cu12 builds) and the
    ``cuda-toolkit[...]`` meta-package (cu13 builds, from 2.14)."""
    script = ("import importlib.metadata as m\n"
              "for r in m.requires('torch') or []:\n"
              "    print(r)")
    pins = []
    for requirement in checked([str(python), "-c", script]).splitlines():
        pin = requirement.split(";")[0].strip()
        if pin.startswith(("nvidia-", "cuda-toolkit")) and "extra ==" not in requirement:
            pins.append(pin)
    return pins


def cuda_library_dirs(python: Path) -> list[Path]:
    """Installs (once) each CUDA library requirement of the installed torch under ``.venv-compat/cuda/``
    (a meta-package with the libraries it pulls in); returns their directories."""
    dirs = []
    for pin in cuda_requirements(python):
        meta = pin.startswith("cuda-toolkit")
        target = CUDA / hashlib.sha256(pin.encode()).hexdigest()[:12] if meta else CUDA / pin.replace("==", "-")
        with CUDA_INSTALL:
            if not (target / ".ready").exists():
                shutil.rmtree(target, ignore_errors=True)
                deps = [] if meta else ["--no-deps"]
                checked([sys.executable, "-m", "pip", "install", "--no-compile", *deps, "--target", str(target), pin],
                        env=PIP_ENV)
                (target / ".ready").write_text(pin)
        dirs.append(target)
    return dirs


def link_cuda_libraries(site: Path, dirs: list[Path]) -> None:
    """Makes the libraries appear where torch's own run paths look (``site-packages/nvidia/...``): each
    file of each directory's ``nvidia/`` tree, linked at the same place under ``site``."""
    for directory in dirs:
        tree = directory / "nvidia"
        for path in sorted(tree.rglob("*")):
            if path.is_dir() or path.suffix == ".pyc":
                continue
            link = site / "nvidia" / path.relative_to(tree)
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(path)


def ensure_venv(version: str, requirements: list[str]) -> Path:
    """``.venv-compat/torch-<version>/`` with that torch, ``requirements`` and trainguard (editable)."""
    venv = COMPAT / f"torch-{version}"
    python = venv / "bin" / "python"
    wanted = hashlib.sha256("\n".join([version, *requirements]).encode()).hexdigest()
    stamp = venv / ".trainguard-compat"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]  # compiled on first import
    if stamp.exists() and stamp.read_text() == wanted:
        checked([*pip, "-e", str(ROOT)], env=PIP_ENV)  # this tree's entry points, whatever pyproject.toml says now
        return python
    print(f"creating {venv.relative_to(ROOT)}", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    checked([sys.executable, "-m", "venv", str(venv)])
    checked([*pip, str(torch_wheel(version))], env=PIP_ENV)
    site = Path(checked([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    link_cuda_libraries(site, cuda_library_dirs(python))
    requirements_file = venv / "requirements.txt"
    requirements_file.write_text("\n".join(requirements) + "\n")
    checked([*pip, "-r", str(requirements_file)], env=PIP_ENV)
    checked([*pip, "-e", str(ROOT)], env=PIP_ENV)
    found = checked([str(python), "-c", "import torch; print(torch.__version__)"]).strip()
    if found.split("+")[0] != version:
        sys.exit(f"test_compat: {venv} imports torch {found}, not {version}")
    stamp.write_text(wanted)
    return python


# ------------------------------------------------------------------------------------------- checks
def venv_env(python: Path) -> dict[str, str]:
    return {"PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "VIRTUAL_ENV": str(python.parent.parent)}


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def train(python: Path, run_dir: Path, steps: int, log: Path) -> subprocess.CompletedProcess:
    return run([str(python), "-m", "trainguard", "train", "--steps", str(steps), "--run-dir", str(run_dir), *TRAIN],
               env=venv_env(python), timeout=600, log=log)


def run_started(run_dir: Path) -> dict:
    """The last ``run_started`` event of a run (where it resumed from; its ``tier`` is set to "durable"
    where the event names none, as for a durable resume)."""
    started = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("kind") == "run_started":
            started = {"tier": "durable", **event}
    return started


def check_version(python: Path, version: str, work: Path, unit_tests: list[str], result: VersionResult) -> None:
    env = venv_env(python)
    logs = work / "logs" / version
    started = time.monotonic()
    demo = run([str(python), "-m", "trainguard", "demo", "--quick", "--out", str(work / f"demo-{version}")],
               env=env, timeout=1200, log=logs / "demo.log")
    result.demo = "passed" if demo.returncode == 0 and "drill passed" in demo.stdout else \
        f"FAILED (exit {demo.returncode}): {last_line(demo.stdout)}"
    result.seconds["demo"] = round(time.monotonic() - started, 1)
    if unit_tests:
        started = time.monotonic()
        unit = run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *unit_tests], env=env,
                   timeout=3600, log=logs / "unit.log")
        summary = last_line(unit.stdout).strip("= ")
        result.unit = summary if unit.returncode == 0 else f"FAILED: {summary}"
        result.seconds["unit"] = round(time.monotonic() - started, 1)
    run_dir = work / "written" / version
    shutil.rmtree(run_dir, ignore_errors=True)
    written = train(python, run_dir, WRITTEN_STEPS, logs / "write.log")
    durable = run_dir / "checkpoints" / f"global_step_{WRITTEN_STEPS}"
    local = run_dir / "local" / "node0" / f"global_step_{WRITTEN_STEPS}"
    result.written = "written" if written.returncode == 0 and durable.is_dir() and local.is_dir() else \
        f"FAILED (exit {written.returncode}): {last_line(written.stdout)}"


def check_load(python: Path, pair: LoadResult, work: Path) -> None:
    """Under ``pair.reader``'s torch: verify, resume from the durable tier, resume from the local tier."""
    source = work / "written" / pair.writer
    logs = work / "logs" / f"{pair.writer}-to-{pair.reader}"
    verify = run([str(python), "-m", "trainguard", "ckpt", "verify", str(source / "checkpoints")],
                 env=venv_env(python), log=logs / "verify.log")
    pair.verify = "verified" if verify.returncode == 0 else f"FAILED (exit {verify.returncode}): {last_line(verify.stdout)}"

    durable_run = work / "loads" / f"{pair.writer}-to-{pair.reader}-durable"
    shutil.rmtree(durable_run, ignore_errors=True)
    shutil.copytree(source, durable_run, symlinks=True)
    shutil.rmtree(durable_run / "local")
    resumed = train(python, durable_run, RESUMED_STEPS, logs / "durable.log")
    started = run_started(durable_run) if resumed.returncode == 0 else {}
    pair.durable = (f"resumed at step {started['step']}" if started.get("tier") == "durable"
                    and started.get("step") == WRITTEN_STEPS else
                    f"FAILED (exit {resumed.returncode}): {last_line(resumed.stdout)}")

    local_run = work / "loads" / f"{pair.writer}-to-{pair.reader}-local"
    shutil.rmtree(local_run, ignore_errors=True)
    shutil.copytree(source, local_run, symlinks=True)
    shutil.rmtree(local_run / "checkpoints" / f"global_step_{WRITTEN_STEPS}")
    resumed = train(python, local_run, RESUMED_STEPS, logs / "local.log")
    started = run_started(local_run) if resumed.returncode == 0 else {}
    refusals = [line for line in resumed.stdout.splitlines() if "passed over" in line]
    if started.get("tier") == "local" and started.get("step") == WRITTEN_STEPS:
        pair.local = f"resumed at step {started['step']}"
    elif started.get("tier") == "durable" and len(refusals) == 1 and pair.writer in refusals[0] \
            and pair.reader in refusals[0]:
        pair.local = f"refused in one line, resumed from durable step {started['step']}"
    else:
        pair.local = f"FAILED (exit {resumed.returncode}): {(refusals or [last_line(resumed.stdout)])[0]}"


# ------------------------------------------------------------------------------------------- report
def table(versions: list[VersionResult], loads: list[LoadResult]) -> str:
    lines = ["| torch | demo --quick | unit tests | checkpoints written |", "|---|---|---|---|"]
    lines += [f"| {v.version} | {v.demo} | {v.unit} | {v.written} |" for v in versions]
    if loads:
        lines += ["", "| written under | loaded under | ckpt verify | durable resume | local-tier resume |",
                  "|---|---|---|---|---|"]
        lines += [f"| {p.writer} | {p.reader} | {p.verify} | {p.durable} | {p.local} |" for p in loads]
    return "\n".join(lines)


def passed(versions: list[VersionResult], loads: list[LoadResult]) -> bool:
    cells = [c for v in versions for c in (v.demo, v.unit, v.written)]
    cells += [c for p in loads for c in (p.verify, p.durable, p.local)]
    return not any(c.startswith("FAILED") for c in cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=os.environ.get("TORCH_VERSIONS", " ".join(DEFAULT_VERSIONS)),
                        help="torch versions, space- or comma-separated (default: %(default)s)")
    parser.add_argument("--unit-tests", default="tests/unit",
                        help="pytest paths run under each version; empty to skip (default: %(default)s)")
    parser.add_argument("--out", default=str(COMPAT / "results"), help="where results and logs go")
    parser.add_argument("--setup-only", action="store_true", help="make the environments, run nothing")
    parser.add_argument("--jobs", type=int, default=1, help="versions (then pairs) checked side by side")
    args = parser.parse_args()
    versions = [v for v in args.versions.replace(",", " ").split() if v]
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    requirements = third_party_requirements()
    # the environments side by side (downloads and unpacking overlap); the checks --jobs at a time
    with ThreadPoolExecutor(max_workers=len(versions)) as pool:
        pythons = dict(zip(versions, pool.map(lambda version: ensure_venv(version, requirements), versions)))
    if args.setup_only:
        return 0

    def check(version: str) -> VersionResult:
        result = VersionResult(version)
        check_version(pythons[version], version, work, args.unit_tests.split(), result)
        print(f"torch {version}: demo {result.demo}; unit {result.unit}; checkpoints {result.written}", flush=True)
        return result

    def load(pair: LoadResult) -> LoadResult:
        check_load(pythons[pair.reader], pair, work)
        print(f"{pair.writer} -> {pair.reader}: verify {pair.verify}; durable {pair.durable}; local {pair.local}",
              flush=True)
        return pair

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(check, versions))
        pairs = [LoadResult(writer.version, reader) for writer in results for reader in versions
                 if reader != writer.version and writer.written == "written"]
        loads = list(pool.map(load, pairs))
    report = table(results, loads)
    (work / "results.md").write_text(report + "\n")
    (work / "results.json").write_text(json.dumps({"versions": [asdict(r) for r in results],
                                                   "loads": [asdict(p) for p in loads]}, indent=1))
    print(report)
    print(f"results: {work / 'results.md'}")
    return 0 if passed(results, loads) else 1


if __name__ == "__main__":
    sys.exit(main())
