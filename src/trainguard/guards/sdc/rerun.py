"""Rerun attribution (Megatron rerun-style) and strikes: who is to blame for a detection. Pure state.

On a level-1 detection (``enabled_level >= 2``) the trainer reruns the same step on the same inputs
and collects the detection points again. At the detected points:

- the rerun's values differ from the first pass (bitwise): a **transient** fault on this rank. A
  strike is recorded; the step goes on with the rerun's gradients (provided the rerun is itself clean:
  pass its values to ``SdcDetector.detect``, which also absorbs them; if it detects again, skip);
- they are identical: the data or the math produced the value, or a **persistent** fault does. The
  step is handled as a data skip. It is a strike only when this rank alone saw it at a point of its
  own (not a reduced gradient) at this step: bad data does not follow one rank from step to step, a
  broken device does, so ``strikes`` such steps exclude it while a single one (a NaN from one bad
  batch) does not;
- no rerun (``rerun: false``): **unverified**, handled as a data skip, no strike.

Strikes are counted per device (host, local device): ``strikes`` of them within
``strike_window_hours`` mark the device faulty, for good. The trainer then writes
``RUN_DIR/faults/faulty_ranks.json`` and stops with exit code 17 (``FaultyDeviceError``) so that the
supervisor can exclude the node. The file (one writer: rank 0 after gathering, or a merge per writer
under a lock of the caller's) is a JSON list::

    [
        {
            "rank": 3,
            "host": "node07",
            "local_device": "cuda:3",
            "strikes": [
                {"step": 120, "rank": 3, "time": 1718000000.0, "kind": "transient", "points": [...], ...},
                ...
            ]
        }
    ]

Detections and strikes are local to the rank that saw them; nothing here communicates. The trainer
all-reduces the verdict (the maximum detection level over the ranks) so that every rank stops or
reruns the same step.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from trainguard.fs.fsio import atomic_write_json
from trainguard.errors import (
    EXIT_FAULTY_HARDWARE,
    CheckpointError,
    ConfigError,
    TrainguardError,
)

KINDS = ("transient", "reproducible", "unverified")
STRIKING_KINDS = ("transient",)  # only a rerun that differs from the first pass is evidence against the device
FAULTY_RANKS_FILE = "faulty_ranks.json"

_STATE_VERSION = 1

Values = Mapping[str, float] | Sequence[float]


class FaultyDeviceError(TrainguardError):
    """A device reached its strike limit; the run stops so that it can be excluded (exit 17)."""

    exit_code = EXIT_FAULTY_HARDWARE


def faulty_ranks_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "faults" / FAULTY_RANKS_FILE


def _bits(value: float) -> bytes:
    return struct.pack("<d", float(value))


def _as_mapping(values: Values) -> dict[str, float]:
    if isinstance(values, Mapping):
        return {str(k): float(v) for k, v in values.items()}
    return {str(i): float(v) for i, v in enumerate(values)}


def _plain(value: Any) -> Any:
    """JSON- and weights_only-safe: non-finite floats become strings, tuples lists, keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _device_label(device: Any) -> int | str:
    return device if isinstance(device, int) and not isinstance(device, bool) else str(device)


class RerunVerdict(IntEnum):
    """What a rank concludes about its own detection after the rerun; the strongest over ranks decides."""

    NONE = 0  # nothing detected at level 1 on this rank
    TRANSIENT = 1  # the rerun differs: use the rerun's gradients
    REPRODUCIBLE = 2  # the rerun detects the same (or there was no rerun): skip the step
    FAULTY = 3  # this device reached its strike limit: save, write faulty_ranks.json, exit 17

    @property
    def label(self) -> str:
        """The spelling in ``sdc_rerun`` events."""
        return self.name.lower()

    def label_after(self, reran: bool) -> str:
        """The spelling in ``sdc_rerun`` events: without a rerun (``guards.sdc.rerun: false``) a skipped
        detection is ``unverified``, as its ``sdc_attribution`` says, never ``reproducible``."""
        return "unverified" if self is RerunVerdict.REPRODUCIBLE and not reran else self.label


@dataclass(frozen=True)
class Attribution:
    kind: str  # "transient" | "reproducible" | "unverified"
    step: int
    rank: int
    points: tuple[str, ...]  # the detected points compared
    differing: tuple[str, ...]  # those whose rerun value differs bitwise from the first pass
    action: str  # "use_rerun" (transient) | "skip_step" (reproducible, unverified)
    strikes: int  # this device's strikes within the window (this one included, when it was one)
    faulty: bool  # the device is faulty: write faulty_ranks.json and stop (FaultyDeviceError)
    message: str  # one line for the log (WARNING; ERROR when faulty)


class StrikeBook:
    """Strikes per device (host, local device); ``strikes`` within ``window_hours`` → faulty for good."""

    def __init__(self, strikes: int = 3, window_hours: float = 8.0):
        if isinstance(strikes, bool) or not isinstance(strikes, int) or strikes < 1:
            raise ValueError(f"strikes must be a positive integer, got {strikes!r}")
        if not window_hours > 0:
            raise ValueError(f"window_hours must be positive, got {window_hours!r}")
        self.strikes = strikes
        self.window_hours = float(window_hours)
        self._book: dict[tuple[str, str], dict[str, Any]] = {}  # key -> {rank, host, local_device, strikes}
        self._faulty: set[tuple[str, str]] = set()

    @property
    def window_seconds(self) -> float:
        return self.window_hours * 3600.0

    @staticmethod
    def _key(host: str, device: Any) -> tuple[str, str]:
        return str(host), str(device)

    def record(self, rank: int, host: str, device: Any, step: int, evidence: Mapping[str, Any],
               now: float | None = None) -> bool:
        """Adds a strike against (host, device) at time ``now`` (seconds since the epoch; default the
        clock) and returns whether the device is faulty: ``strikes`` strikes at most ``window_hours``
        old (including this one), now or earlier. Strikes that fell out of the window are forgotten,
        except those of a faulty device, which are kept as its evidence."""
        now = time.time() if now is None else float(now)
        key = self._key(host, device)
        entry = self._book.setdefault(key, {"rank": int(rank), "host": str(host),
                                            "local_device": _device_label(device), "strikes": []})
        entry["rank"] = int(rank)
        strike = {key_: value for key_, value in _plain(dict(evidence)).items() if key_ not in ("step", "rank", "time")}
        entry["strikes"].append({"step": int(step), "rank": int(rank), "time": now, **strike})
        if key not in self._faulty:
            entry["strikes"] = [s for s in entry["strikes"] if now - s["time"] <= self.window_seconds]
            if len(entry["strikes"]) >= self.strikes:
                self._faulty.add(key)
        return key in self._faulty

    def count(self, host: str, device: Any, now: float | None = None) -> int:
        """The device's strikes at most ``window_hours`` old."""
        now = time.time() if now is None else float(now)
        entry = self._book.get(self._key(host, device))
        if entry is None:
            return 0
        return sum(1 for s in entry["strikes"] if now - s["time"] <= self.window_seconds)

    def is_faulty(self, host: str, device: Any) -> bool:
        return self._key(host, device) in self._faulty

    def forget(self, host: str, device: Any) -> None:
        """Drops the device's strikes and its faulty mark: it was replaced (live mode: a struck-out rank's
        process leaves and another, on another device, takes its place under the same key)."""
        key = self._key(host, device)
        self._book.pop(key, None)
        self._faulty.discard(key)

    def faulty_entries(self) -> list[dict[str, Any]]:
        """The faulty devices as ``faulty_ranks.json`` entries."""
        return [_copy_entry(self._book[key]) for key in sorted(self._faulty)]

    # ----------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain ints, floats, strings, lists and dicts: loads with ``torch.load(weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "devices": [dict(_copy_entry(entry), faulty=key in self._faulty) for key, entry in sorted(self._book.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"unsupported version {state.get('version')!r}")
            book: dict[tuple[str, str], dict[str, Any]] = {}
            faulty: set[tuple[str, str]] = set()
            for device in state["devices"]:
                entry = _validate_entry(device)
                key = self._key(entry["host"], entry["local_device"])
                book[key] = entry
                if device["faulty"] is True:
                    faulty.add(key)
                elif device["faulty"] is not False:
                    raise ValueError(f"faulty must be true or false, got {device['faulty']!r}")
        except KeyError as exc:
            raise CheckpointError(f"sdc strike book state is malformed: missing key {exc}") from None
        except (AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"sdc strike book state is malformed: {exc}") from None
        self._book, self._faulty = book, faulty


def _copy_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {"rank": entry["rank"], "host": entry["host"], "local_device": entry["local_device"],
            "strikes": [dict(s) for s in entry["strikes"]]}


def _validate_entry(entry: Any) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        raise TypeError(f"an entry must be a mapping, got {entry!r}")
    rank, host, device, strikes = entry["rank"], entry["host"], entry["local_device"], entry["strikes"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    if not isinstance(host, str):
        raise TypeError(f"host must be a string, got {host!r}")
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise TypeError(f"local_device must be an integer or a string, got {device!r}")
    if not isinstance(strikes, list):
        raise TypeError(f"strikes must be a list, got {strikes!r}")
    for strike in strikes:
        if not isinstance(strike, Mapping) or not isinstance(strike.get("time"), (int, float)) \
                or isinstance(strike.get("step"), bool) or not isinstance(strike.get("step"), int):
            raise TypeError(f"a strike must be a mapping with an integer step and a time, got {strike!r}")
    return {"rank": rank, "host": host, "local_device": device, "strikes": [dict(s) for s in strikes]}


class RerunAttribution:
    """Attributes a level-1 detection from the first pass and the rerun of the step, on this rank."""

    def __init__(self, strike_book: StrikeBook, host: str, device: Any):
        self.strike_book = strike_book
        self.host = host
        self.device = device

    def on_detection(self, step: int, rank: int, first_values: Values, rerun_values: Values | None,
                     now: float | None = None, local: bool = True, alone: bool = False) -> Attribution:
        """``first_values``: the detected points' values of the first pass (``{point: value}``, or a
        list compared position by position); ``rerun_values``: the rerun's values of (at least) those
        points, or None when there was no rerun. Records a strike for a transient fault seen at a
        ``local`` point (one whose value this rank computed alone: not a gradient already reduced
        over the ranks, which carries any rank's fault), or for a reproducible one seen at such a
        point by this rank ``alone`` (every other rank, with other data, was clean), and returns the
        attribution."""
        first = _as_mapping(first_values)
        points = tuple(first)
        if rerun_values is None:
            kind, differing, rerun = "unverified", (), None
        else:
            rerun = _as_mapping(rerun_values)
            differing = tuple(p for p in points if p not in rerun or _bits(rerun[p]) != _bits(first[p]))
            kind = "transient" if differing else "reproducible"
        action = "use_rerun" if kind == "transient" else "skip_step"
        evidence: dict[str, Any] = {"kind": kind, "points": list(points), "first_values": first}
        if rerun is not None:
            evidence["rerun_values"] = {p: rerun[p] for p in points if p in rerun}
        # a strike is evidence against the hardware: a rerun that differs is. A reproducible value is
        # the data's or the math's, unless this rank alone produces it at a point of its own: bad data
        # does not follow one rank from step to step (each step's batches differ), a broken device does,
        # so ``strikes`` such steps exclude it, while a single one does not. No rerun proves nothing
        persistent = kind == "reproducible" and alone
        struck = (kind in STRIKING_KINDS or persistent) and local
        if struck:
            faulty = self.strike_book.record(rank, self.host, self.device, step, evidence, now)
        else:
            faulty = self.strike_book.is_faulty(self.host, self.device)
        strikes = self.strike_book.count(self.host, self.device, now)
        what = {
            "transient": "rerun differs: transient fault on this rank, the rerun's gradients are used",
            "reproducible": ("rerun identical on this rank alone: a persistent fault or the data, the step is skipped"
                             if persistent else "rerun identical: the data or the math produced it, the step is skipped"),
            "unverified": "no rerun: the step is skipped",
        }[kind]
        tally = (f"strike {strikes} of {self.strike_book.strikes} within {self.strike_book.window_hours:g} h"
                 if struck else f"no strike ({strikes} of {self.strike_book.strikes} within "
                                f"{self.strike_book.window_hours:g} h)")
        message = (
            f"sdc attribution: step {step}, rank {rank}, host {self.host}, local device {self.device}, "
            f"points {', '.join(points)}: {what}; {tally}" + ("; the device is faulty" if faulty else "")
        )
        return Attribution(kind, step, rank, points, differing, action, strikes, faulty, message)


# ------------------------------------------------------------------------------- faulty_ranks.json
def read_faulty_ranks(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The entries of a ``faulty_ranks.json``; ``[]`` when it does not exist; ConfigError naming the
    file when it is malformed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read faulty ranks file: {exc}") from None
    try:
        data = json.loads(text)
        if not isinstance(data, list):
            raise TypeError(f"expected a JSON list of devices, got {type(data).__name__}")
        return [_validate_entry(entry) for entry in data]
    except KeyError as exc:
        raise ConfigError(f"{path}: malformed faulty ranks file: an entry lacks {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: malformed faulty ranks file: {exc}") from None


def write_faulty_ranks(path: str | os.PathLike, entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merges ``entries`` (e.g. ``StrikeBook.faulty_entries()``, possibly gathered from every rank)
    into the file at ``path`` (normally ``faulty_ranks_path(run_dir)``; parent directories are
    created) and rewrites it atomically. An entry replaces the file's entry for the same (host,
    local device); the others are kept. Returns the entries written. Writers are serialised by a lock
    on the file's directory (several ranks reach their strike limit in the same step: without it, one
    rank's read-merge-write could drop another's entry)."""
    path = Path(path)
    new_entries = [_validate_entry(_plain(dict(e))) for e in entries]
    path.parent.mkdir(parents=True, exist_ok=True)
    with _directory_lock(path.parent):
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        for entry in [*read_faulty_ranks(path), *new_entries]:
            merged[(entry["host"], str(entry["local_device"]))] = entry
        records = list(merged.values())
        atomic_write_json(path, records, indent=4)
    return records


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the directory itself: no lock file is left behind."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
