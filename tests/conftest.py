"""Session fixtures shared by the tests (helpers live in tests/helpers/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.runs import ok, train


@pytest.fixture(scope="session")
def committed_run(tmp_path_factory) -> Path:
    """A finished 2-rank run with checkpoints at steps 4 and 8, shared by read-only tests."""
    run_dir = tmp_path_factory.mktemp("committed") / "run"
    ok(train(run_dir, 2, 8, "--save-interval", "4"))
    return run_dir
