"""``trainguard demo --quick``: the drill passes and says so on its last line."""

from conftest import trainguard


def test_demo_quick_passes(tmp_path):
    proc = trainguard("demo", "--quick", "--out", str(tmp_path / "demo"), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = " ".join(proc.stdout.split())  # rich wraps long lines
    assert "drill passed: 4/4 faults handled, final parameters identical to the fault-free run" in last
