"""Structured events: one JSON object per line in ``RUN_DIR/events.jsonl``."""

from trainguard.events.log import EventLog, read_events

__all__ = ["EventLog", "read_events"]
