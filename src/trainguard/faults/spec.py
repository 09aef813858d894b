"""The ``TRAINGUARD_FAULTS`` grammar: ``<kind>:<key>=<value>[,...]`` entries separated by ``;``.

Pure parsing, no I/O: the injector decides when and where a parsed fault fires.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from trainguard.errors import ConfigError

FILE_KINDS = ("corrupt", "truncate", "delete")
WHERE_CHOICES = ("grad_input", "output")
STATE_CHOICES = ("weight", "exp_avg", "exp_avg_sq")  # stateflip: the parameter itself or an Adam moment
DEFAULT_SPIKE_FACTOR = 1e4

_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class FaultSpec:
    """One parsed fault; ``params`` holds the kind's remaining keys, typed, defaults filled in."""

    index: int
    kind: str
    text: str
    rank: int | None
    step: int
    persistent: bool
    params: dict


def _non_negative_int(value: str) -> int:
    if not _DIGITS.fullmatch(value):
        raise ValueError(f"must be a non-negative integer, got {value!r}")
    return int(value)


def _number(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"must be a number, got {value!r}") from None
    if math.isnan(number):
        # a NaN factor would be a different fault than the one asked for: the nan kind exists for it
        raise ValueError(f"must be a number, got {value!r} (use the nan fault to inject NaN)")
    return number


def _seconds(value: str) -> float:
    seconds = _number(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"must be a finite number >= 0, got {value!r} (leave it out to hang for ever)")
    return seconds


def _non_empty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def _where(value: str) -> str:
    if value not in WHERE_CHOICES:
        raise ValueError(f"must be one of {'|'.join(WHERE_CHOICES)}, got {value!r}")
    return value


def _state(value: str) -> str:
    if value not in STATE_CHOICES:
        raise ValueError(f"must be one of {'|'.join(STATE_CHOICES)}, got {value!r}")
    return value


def _bit(value: str) -> int | str:
    if value in ("exp", "sign"):
        return value
    if _DIGITS.fullmatch(value) and int(value) <= 31:
        return int(value)
    raise ValueError(f"must be 0..31, 'exp' or 'sign', got {value!r}")


def _flag(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise ValueError(f"must be 0, 1, true or false, got {value!r}")


_VALUE_PARSERS: dict[str, Callable[[str], Any]] = {
    "rank": _non_negative_int,
    "step": _non_negative_int,
    "index": _non_negative_int,
    "seconds": _seconds,
    "factor": _number,
    "site": _non_empty,
    "file": _non_empty,
    "where": _where,
    "state": _state,
    "bit": _bit,
    "persistent": _flag,
    "rep": _non_negative_int,
    "node": _non_empty,  # any kind: fires only on the node of that name (TRAINGUARD_NODE, else the host)
}
# wipe's node is the local tier's node index (rank // parallel.ranks_per_node), not a node name
_KIND_VALUE_PARSERS: dict[tuple[str, str], Callable[[str], Any]] = {("wipe", "node"): _non_negative_int}

# kind -> (required keys, optional keys with their defaults)
_SCHEMA: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "kill": (("rank", "step"), {"persistent": False}),
    "hang": (("rank", "step"), {"seconds": None, "persistent": False}),
    # persistent spikes are allowed too: consecutive spikes are how a data-skip abort is drilled
    "spike": (("step",), {"factor": DEFAULT_SPIKE_FACTOR, "persistent": False}),
    "nan": (("step",), {"rank": 0, "persistent": False}),
    "bitflip": (("rank", "step", "site", "where"), {"bit": "exp", "index": 0, "persistent": False}),
    "scale": (("rank", "step", "site", "where", "factor"), {"persistent": False}),
    # flips a bit of state at rest, before the step's forward: a parameter (site = its dotted name) or
    # its Adam moment, in this rank's shard
    "stateflip": (("rank", "step", "site", "state"), {"bit": "exp", "index": 0, "persistent": False}),
    "corrupt": (("step", "file"), {}),
    "truncate": (("step", "file"), {}),
    "delete": (("step", "file"), {}),
    # trainguard doctor only: flips a bit of burn-in repetition `rep`'s result on local rank `rank` (all if absent)
    "miscompute": (("rep",), {"rank": None, "bit": "exp", "index": 0}),
    # deletes node N's whole local-tier directory after step S's local save (a replaced node, a wiped disk)
    "wipe": (("node", "step"), {}),
}
DOCTOR_KINDS = ("miscompute",)  # not tied to a training step (FaultSpec.step is 0); the trainer ignores them
KINDS = tuple(_SCHEMA)


def _parse_entry(index: int, text: str) -> FaultSpec:
    def bad(reason: str) -> ConfigError:
        return ConfigError(f"bad fault {text!r}: {reason}")

    kind, colon, body = text.partition(":")
    kind = kind.strip()
    if not colon:
        raise bad("expected <kind>:<key>=<value>[,<key>=<value>...]")
    if kind not in _SCHEMA:
        raise bad(f"unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
    required, optional = _SCHEMA[kind]

    values: dict[str, Any] = dict(optional)
    given: set[str] = set()
    for item in body.split(","):
        if not item.strip():
            continue
        key, equals, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not equals:
            raise bad(f"expected <key>=<value>, got {item.strip()!r}")
        if key not in required and key not in optional and key != "node":  # node= narrows any kind to one node
            raise bad(f"unknown key {key!r} for {kind} (allowed: {', '.join(required + tuple(optional) + ('node',))})")
        if key in given:
            raise bad(f"key {key!r} given twice")
        try:
            values[key] = _KIND_VALUE_PARSERS.get((kind, key), _VALUE_PARSERS[key])(raw)
        except ValueError as error:
            raise bad(f"{key} {error}") from None
        given.add(key)

    missing = [key for key in required if key not in given]
    if missing:
        raise bad(f"missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)} for {kind}")

    rank = values.pop("rank", None)
    step = values.pop("step", 0)  # only DOCTOR_KINDS lack it (it is required for every other kind)
    persistent = values.pop("persistent", False)
    return FaultSpec(index=index, kind=kind, text=text, rank=rank, step=step, persistent=persistent, params=values)


def parse_faults(text: str | None) -> list[FaultSpec]:
    """Parses a fault list; ``None`` or blank means no faults, empty entries are ignored."""
    if text is None:
        return []
    entries = [entry.strip() for entry in text.split(";")]
    return [_parse_entry(index, entry) for index, entry in enumerate(entry for entry in entries if entry)]
