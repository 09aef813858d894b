"""``trainguard demo --quick``: the drill passes, says so on its last line, and leaves its products."""

import json

from helpers.runs import trainguard


def test_demo_quick_passes(tmp_path):
    out = tmp_path / "demo"
    proc = trainguard("demo", "--quick", "--out", str(out), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = " ".join(proc.stdout.split())  # rich wraps long lines
    assert "drill passed: 5/5 faults handled, final parameters identical to the fault-free run" in last
    events = [json.loads(line) for line in (out / "faulty" / "events.jsonl").read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"data_skip", "local_recovery", "restart", "recovered", "sdc_rerun", "lifecycle_stop"} <= kinds
    assert (out / "faulty" / "report.html").stat().st_size > 10_000
    assert (out / "hf" / "config.json").is_file() and list((out / "hf").glob("*.safetensors"))
