"""``benchmarks/run_all`` collects every benchmark's RESULT lines and lists every failure; the sections
measured by hand below its marker line survive a rewrite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUN_ALL = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all"
KEPT_MARKER = "<!-- run_all writes the part above this line; the part below is kept when it writes the file -->"

GOOD = """
import json, sys
assert "--quick" in sys.argv, sys.argv
print("measuring...")
print("RESULT " + json.dumps({"figure": "save GB/s", "trainguard": 0.9, "baseline": 1.0, "ratio": 0.9,
                              "target": ">= 0.9", "met": True}))
print("RESULT " + json.dumps({"figure": "blocked s", "trainguard": 0.1, "baseline": 1.0, "ratio": 0.1,
                              "target": "<= 0.05", "met": False}))
"""
CRASHES = 'print("RESULT {\\"figure\\": \\"half\\", \\"trainguard\\": 1, \\"baseline\\": 2, \\"ratio\\": 0.5, ' \
          '\\"target\\": \\"x\\", \\"met\\": true}")\nraise SystemExit("out of memory")\n'
SILENT = 'print("done, but nothing to collect")\n'
MALFORMED = 'print("RESULT {not json")\n'


def test_run_all_collects_results_and_lists_failures(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    for name, text in (("good.py", GOOD), ("crashes.py", CRASHES), ("silent.py", SILENT),
                       ("malformed.py", MALFORMED), ("common.py", "raise SystemExit(9)\n")):
        (bench / name).write_text(text)
    old_run = "| stale figure | 1 | 1 | 1 | x | yes | gone.py |"
    hand = "## Measured by hand (issue 99)\n\n| figure | value |\n|---|---|\n| kept | 42 |\n"
    (bench / "RESULTS.md").write_text(f"# Benchmark results\n\n{old_run}\n\n{KEPT_MARKER}\n\n{hand}")
    proc = subprocess.run([sys.executable, str(RUN_ALL), "--quick", "--dir", str(bench), "--python", sys.executable,
                           "--logs", str(tmp_path / "logs"), "--label", "test machine"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = (bench / "RESULTS.md").read_text()
    assert "| save GB/s | 0.9 | 1 | 0.9 | >= 0.9 | yes | good.py |" in results
    assert "| blocked s | 0.1 | 1 | 0.1 | <= 0.05 | **no** | good.py |" in results
    assert "| half | 1 | 2 | 0.5 | x | yes | crashes.py |" in results
    failed = results.split("## Failed benchmarks")[1].split("## Runs")[0]
    assert "| crashes.py | exit status 1 | `out of memory` |" in failed
    assert "| silent.py | printed no RESULT line |" in failed
    assert "| malformed.py | malformed RESULT line" in failed
    assert "good.py" not in failed and "common.py" not in results
    for fact in ("**Note:** test machine", "| cores |", "| RAM |", "torch", "| total time |", "benchmarks/run_all --quick"):
        assert fact in results
    assert old_run not in results and results.endswith(f"{KEPT_MARKER}\n\n{hand}")
    assert (tmp_path / "logs" / "crashes.log").read_text().strip().endswith("out of memory")
    commit = subprocess.run(["git", "-C", str(RUN_ALL.parent), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    assert f"| commit | {commit} |" in results
    assert f"at commit {commit}," in proc.stdout and f"commit {commit})" in proc.stdout  # the console says it too


def test_run_all_unknown_benchmark(tmp_path):
    proc = subprocess.run([sys.executable, str(RUN_ALL), "--only", "nope", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip() == f"run_all: error: no benchmark nope.py in {tmp_path}"
