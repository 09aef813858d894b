"""The live launcher forks the ranks it starts as this interpreter (``python -m MODULE`` or ``python
SCRIPT``) from its ranks' fork server, a one-thread copy of it taken before its store's threads: each
rank finds what a new interpreter would (``__main__``, argv, ``sys.path[0]``, the launcher's
environment and working directory, its stdout, torch's thread count), and its
parent is the server, not the launcher. A launcher that has threads already starts them cold.

Ranks here are stand-ins that say what they found, mark their end in the launcher's store as a finished
rank does, and exit 0 (the launcher's loop ends when every rank has); the live tests (tests/integration/test_live_*.py) run real ones through the same path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.finished_rank import MARK_FINISHED
from trainguard.live.launcher import is_this_interpreter, runs_a_file_or_module

SRC = str(Path(__file__).resolve().parents[3] / "src")

RANK = r"""
import json, os, sys
import torch
rank = sys.argv[sys.argv.index("--rank") + 1]
print(f"rank {rank} says hello", flush=True)
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
found = {"name": __name__, "argv0": sys.argv[0], "path0": sys.path[0], "cwd": os.getcwd(),
         "marker": os.environ.get("MARKER"), "torch_threads": torch.get_num_threads(), "parent": os.getppid(),
         "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task"))}
with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as file:
    json.dump(found, file)
""" + MARK_FINISHED

LAUNCHER = r"""
import json, os, sys, threading, time
from pathlib import Path
from trainguard.live.launcher import LiveRun, launch
entry, threaded, executable = json.loads(sys.argv[1]), sys.argv[2] == "threaded", sys.argv[3]
if threaded:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
os.environ["MARKER"] = "set by the launcher before the run"
launch(Path("run"), LiveRun(groups=2, group_size=1, steps=1, micro_batches=2, entry=tuple(entry), executable=executable))
print(json.dumps({"launcher": os.getpid()}), flush=True)
"""


@pytest.mark.parametrize("how", ["script", "module", "threaded", "name on PATH"])
def test_a_rank_started_as_this_interpreter_is_forked_and_finds_what_a_new_interpreter_would(tmp_path, how):
    """"name on PATH": the documented ``-- python script.py`` (this interpreter's name, found on PATH)."""
    script = tmp_path / "stand_in_rank.py"
    script.write_text(RANK)
    entry = ["-m", "stand_in_rank"] if how == "module" else [str(script)]
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    executable = sys.executable
    if how == "name on PATH":
        executable = Path(sys.executable).name
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    done = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(entry), how, executable], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher = json.loads(done.stdout.strip().splitlines()[-1])["launcher"]
    for rank in (0, 1):
        found = json.loads((tmp_path / "run" / f"rank{rank}.json").read_text())
        assert f"rank {rank} says hello" in done.stdout
        assert found["name"] == "__main__" and Path(found["argv0"]) == script
        assert Path(found["path0"]) == tmp_path and Path(found["cwd"]) == tmp_path
        assert found["marker"] == "set by the launcher before the run"
        assert found["torch_threads"] == 1  # the launcher's OMP_NUM_THREADS=1 for its ranks
        if how == "threaded":  # started cold, the launcher's child
            assert found["parent"] == launcher
        else:  # forked by the server, a one-thread child of the launcher
            assert found["parent"] != launcher and found["parent_threads"] == 1


def test_this_interpreter_is_its_path_or_its_name_on_path_not_a_link_from_elsewhere(tmp_path, monkeypatch):
    """A link to this interpreter's file from another directory is another environment (a venv's python
    and its base interpreter are one file: started there, this test's own rank could not import torch)."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    assert is_this_interpreter(sys.executable) and is_this_interpreter(Path(sys.executable).name)
    (tmp_path / "bin").mkdir()
    os.symlink(sys.executable, tmp_path / "bin" / "python")
    assert not is_this_interpreter(str(tmp_path / "bin" / "python"))
    assert not is_this_interpreter(str(tmp_path / "no-such-python"))


def test_only_a_script_or_a_module_is_forked_any_other_option_starts_a_new_interpreter():
    """``-- python -c CODE`` was forked as if ``-c`` were a script's path (FileNotFoundError on every rank)."""
    assert runs_a_file_or_module(("train.py", "--config", "x.yaml"))
    assert runs_a_file_or_module(("-m", "trainguard.live.workload"))
    assert not runs_a_file_or_module(("-c", "print(1)"))
    assert not runs_a_file_or_module(("-u", "train.py"))
    assert not runs_a_file_or_module(())
