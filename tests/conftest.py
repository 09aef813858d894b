"""Session fixtures shared by the tests (helpers live in tests/helpers/)."""

from __future__ import annotations

import compileall
from pathlib import Path

import pytest

import trainguard
from helpers.runs import ok, train
from helpers.suite_schedule import make_scheduler, schedule_rank

ROOT = Path(__file__).resolve().parents[1]
# what the interpreters the suite starts import from this checkout (the package is installed editable)
IMPORTED_SOURCES = (Path(trainguard.__file__).parent, ROOT / "tests" / "helpers", ROOT / "examples", ROOT / "benchmarks")


def pytest_sessionstart(session) -> None:
    """Byte-compiles the sources the suite's interpreters import, once (only the stale files; a second
    session compiles nothing). Where PYTHONDONTWRITEBYTECODE is set (it is on the machines the suite runs
    on) no interpreter writes the cache, so each of the hundreds the suite starts (supervisors,
    torchrun's ranks, helper scripts) compiled trainguard's modules from source again: 10% of the CPU
    of tests/integration/test_guard_user_loop.py (102 -> 91 CPU-seconds, loaded machine). Python reads
    a cache file only while it matches its source's size and time, so an edit is never run stale.
    With pytest-xdist, the controlling process compiles before it starts the workers, and the workers
    do not: two processes compiling one file at once could write its cache file at once."""
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker
        return
    for directory in IMPORTED_SOURCES:
        compileall.compile_dir(directory, quiet=2)


def pytest_collection_modifyitems(config, items) -> None:
    """On a pytest-xdist worker, the longest units first (``helpers/suite_schedule.py``): the controller
    hands the units out in this order."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: schedule_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: only a run with workers (-n) calls it
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)


@pytest.fixture(scope="session")
def committed_run(tmp_path_factory) -> Path:
    """A finished 2-rank run with checkpoints at steps 4 and 8, shared by read-only tests."""
    run_dir = tmp_path_factory.mktemp("committed") / "run"
    ok(train(run_dir, 2, 8, "--save-interval", "4"))
    return run_dir
