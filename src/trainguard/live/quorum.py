"""The membership of each epoch, agreed through one ``TCPStore`` that the launcher hosts.

A *quorum* (epoch ``e``) is the list of ranks that step together on one gloo process group made for
that epoch alone (``pg/<e>`` prefix of the store), from ``start_step`` on. Epochs are numbered without
gaps and every rank walks them in order, so two ranks never disagree about which group a collective
belongs to. The launcher's :class:`~trainguard.live.lighthouse.Lighthouse` writes the records; ranks
only read them and write their own reports (``report/<e>/<rank>``: the last step they committed,
``ready/<rank>``: a count of the times they asked to join).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch.distributed as dist

LATEST = "latest"  # the newest published epoch
MAX_STEP = 2 ** 62  # the bound of a step or an epoch read back from the store (any run's are far below)
NO_STATE = -1  # a report (``report/<e>/<rank>``) of a joiner whose state transfer failed: its group holds no state


def epoch_key(epoch: int) -> str:
    return f"epoch/{epoch}"


def report_key(epoch: int, rank: int) -> str:
    return f"report/{epoch}/{rank}"


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def start_key(epoch: int) -> str:
    """A join epoch's first step: the survivors choose it (the step boundary after they all saw the
    epoch) and its source rank writes it for the joiners."""
    return f"start/{epoch}"


def progress_key(rank: int) -> str:
    return f"progress/{rank}"


def started_key(rank: int) -> str:
    """A count each process of this rank raises once, as soon as it reaches the store: a process started
    on a node that ends before its count moved never ran as the rank (its node command failed)."""
    return f"started/{rank}"


def spare_started_key(index: int) -> str:
    """``started_key``'s count for warm spare ``index``."""
    return f"spare_started/{index}"


def spare_key(index: int) -> str:
    """The rank a warm spare is to replace, set by the launcher when a rank dies."""
    return f"spare/{index}"


def spare_ready_key(index: int) -> str:
    """Set by a spare once it has imported everything and waits for its rank."""
    return f"spare_ready/{index}"


def spare_failed_key(index: int) -> str:
    """Set by a spare whose self-test failed (the reason): the launcher never hands it a rank."""
    return f"spare_failed/{index}"


def entered_key(rank: int) -> str:
    """The newest epoch whose process group this rank has built: the lighthouse lets a group rejoin only
    once every member has entered the current epoch (a join published before that would leave a member
    building the older epoch's group when another dies, watching an epoch nobody ends)."""
    return f"entered/{rank}"


def done_key(rank: int) -> str:
    """Set by a rank that has written its final state: it beats no more and is not hung."""
    return f"done/{rank}"


def fence_key(rank: int) -> str:
    """The newest epoch in which this rank's process was declared dead (exited, or silent for the
    heartbeat timeout). A process of this rank whose epoch is not newer is stale: it must never report,
    ask to join or step again, even if it comes back (a cut link restored)."""
    return f"fence/{rank}"


STOP = "stop"
"""Set by the launcher when it is asked to stop (SIGTERM): the quorum saves at its next step boundary
and every member exits ``EXIT_RESUMABLE_STOP``; the job resumes from that checkpoint."""

STOPPED = "stopped"
"""Set by the quorum's first member when the quorum stopped at a step boundary (a lifecycle reason, or
``train.exit_at_step``): JSON ``{"step", "reason", "message"}``, for the launcher's last line."""


GIVEN_UP = "given_up"
"""Set by the launcher when it gives a rank up (``live.start_failure``): JSON, the ranks not started again."""


def awaited_at_end(store: dist.Store, world: int, group_size: int) -> set[int]:
    """The ranks the quorum waits for at the run's end, to write the final state together: every rank of each
    replica group none of whose ranks the launcher gave up (``GIVEN_UP``: they never rejoin)."""
    given_up = json.loads(store.get(GIVEN_UP)) if has(store, GIVEN_UP) else []
    out = {rank // group_size for rank in given_up}
    return {rank for rank in range(world) if rank // group_size not in out}


def beat_key(rank: int) -> str:
    """A counter each rank raises while it computes and while it waits (collectives, the lighthouse):
    a rank whose counter stops is hung, stopped or cut off."""
    return f"beat/{rank}"


@dataclass(frozen=True)
class Quorum:
    epoch: int
    members: list[int]  # global ranks, ascending: a member's index is its rank in the epoch's group
    start_step: int | None  # None for a join epoch until the survivors fix it (start_key)
    reason: str
    joining: list[int] = field(default_factory=list)  # ranks that receive the state at the start
    source: int | None = None  # the live member whose state the joiners receive
    resume_from: int | None = None  # restart mode: the checkpoint step every rank loads

    def index(self, rank: int) -> int:
        return self.members.index(rank)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Quorum:
        return cls(**json.loads(text))


def publish(store: dist.Store, quorum: Quorum) -> None:
    store.set(epoch_key(quorum.epoch), quorum.to_json())
    store.set(LATEST, str(quorum.epoch))


def latest_epoch(store: dist.Store) -> int:
    return int(store.get(LATEST))


def read_quorum(store: dist.Store, epoch: int) -> Quorum:
    return Quorum.from_json(store.get(epoch_key(epoch)))


def has(store: dist.Store, key: str) -> bool:
    return store.check([key])


def wait_for(store: dist.Store, key: str, timeout_s: float, beat: Callable[[], None],
             poll_s: float = 0.005) -> bytes:
    """The key's value once it exists; polling (not ``store.wait``) so a timeout names the key and the
    rank keeps beating."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        beat()
        if time.monotonic() > deadline:
            raise TimeoutError(f"live recovery: no {key!r} in the store after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return store.get(key)
