"""Fixtures of the step tests that build a guard in the test's own process."""

from __future__ import annotations

import logging
import signal

import pytest

from trainguard.events.rank_logging import LOGGER_NAME


@pytest.fixture
def quiet(monkeypatch):
    """The guard's logging and signal handlers are the test's, not pytest's."""
    monkeypatch.setattr(logging.getLogger(LOGGER_NAME), "handlers", [logging.NullHandler()])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
