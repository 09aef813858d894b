"""How the suite is shared between pytest-xdist workers (``tests/helpers/suite_schedule.py``) and the
ports each worker picks (``tests/helpers/ports.py``), checked on the tests' own source and real sockets."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

from helpers import ports
from helpers.suite_schedule import LONGEST_FIRST, SAME_WORKER, schedule_rank, unit_of

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def _session_fixtures() -> set[str]:
    """The session-scoped fixtures of tests/integration/conftest.py."""
    tree = ast.parse((INTEGRATION / "conftest.py").read_text())
    names = set()
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        for decorator in function.decorator_list:
            keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
            if any(k.arg == "scope" and getattr(k.value, "value", None) == "session" for k in keywords):
                names.add(function.name)
    return names


def _fixtures_asked_for(path: Path) -> set[str]:
    """Every name a function of ``path`` takes as a parameter or asks ``request.getfixturevalue`` for."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            names.update(argument.arg for argument in node.args.args)
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getfixturevalue"
                and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def test_every_user_of_an_integration_session_fixture_shares_a_worker_with_the_others():
    fixtures = _session_fixtures()
    assert {"slurm", "live_fsdp_clean"} <= fixtures
    for fixture in fixtures:
        users = sorted(path.name for path in INTEGRATION.glob("test_*.py") if fixture in _fixtures_asked_for(path))
        assert users, fixture
        if len(users) > 1:
            assert sorted(SAME_WORKER[fixture]) == users, fixture


def test_every_file_named_in_a_group_exists():
    for files in SAME_WORKER.values():
        for name in files:
            assert (INTEGRATION / name).is_file(), name
    assert set(LONGEST_FIRST) <= set(SAME_WORKER) | {f"tests/integration/{p.name}" for p in INTEGRATION.glob("test_*.py")}


def test_a_groups_files_are_one_unit_and_other_files_their_own():
    assert unit_of("tests/integration/test_live_slurm.py::test_x[a]") == "slurm"
    assert unit_of("tests/integration/test_slurm.py::test_y") == "slurm"
    assert unit_of("tests/integration/test_demo.py::test_z") == "tests/integration/test_demo.py"
    assert unit_of("tests/unit/live/test_slurm.py::test_w") == "tests/unit/live/test_slurm.py"


def test_the_longest_units_go_first_and_every_test_keeps_its_place_inside_its_unit():
    collected = ["tests/integration/test_a.py::t1", "tests/integration/test_slurm.py::t1",
                 "tests/integration/test_a.py::t2", "tests/integration/test_live_slurm.py::t1",
                 "tests/integration/test_slurm.py::t2", "tests/unit/test_b.py::t1"]
    assert sorted(collected, key=schedule_rank) == [
        "tests/integration/test_slurm.py::t1", "tests/integration/test_live_slurm.py::t1",
        "tests/integration/test_slurm.py::t2", "tests/integration/test_a.py::t1", "tests/integration/test_a.py::t2",
        "tests/unit/test_b.py::t1"]


def test_the_blocks_lie_below_the_kernels_ephemeral_ports_and_trainguards_launcher_ports():
    lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ports.FIRST_PORT + ports.MAX_WORKERS * ports.BLOCK <= min(lowest_ephemeral, 29400)


# The picks below are made in blocks moved to 28000-28999, which no worker of this suite uses.
@pytest.mark.parametrize("worker, block", [(None, 0), ("gw0", 0), ("gw1", 1), ("gw3", 3)])
def test_each_worker_picks_distinct_free_ports_from_its_own_block(monkeypatch, worker, block):
    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(ports, "FIRST_PORT", 28000)
    monkeypatch.setattr(ports, "BLOCK", 200)
    picked = ports.free_ports(20)
    first = 28000 + block * 200
    assert len(set(picked)) == 20 and all(first <= port < first + 200 for port in picked), picked


def test_a_port_something_listens_on_is_never_picked(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setattr(ports, "FIRST_PORT", 28000)
    monkeypatch.setattr(ports, "BLOCK", 16)
    first = 28000 + 2 * 16
    listeners = []
    try:  # every port of the block but the last two held: the picks are those two
        for port in range(first, first + 14):
            listener = socket.socket()
            try:
                listener.bind(("127.0.0.1", port))
            except OSError:
                listener.close()
                continue
            listeners.append(listener)
        assert len(listeners) == 14
        assert sorted(ports.free_ports(2)) == [first + 14, first + 15]
    finally:
        for listener in listeners:
            listener.close()


def test_a_worker_beyond_the_blocks_is_refused(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{ports.MAX_WORKERS}")
    with pytest.raises(RuntimeError, match="port blocks for 4 pytest-xdist workers, not gw4"):
        ports.free_port()
