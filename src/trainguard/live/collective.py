"""Waiting on a collective while watching for the end of its epoch.

A rank blocked in a gloo collective hears about a dead peer only from a socket it shares with it; a
rank of the ring that has none waits for the whole collective timeout (30 s measured here). So ranks
wait by polling the work and the store's ``abort/<epoch>`` key, which the lighthouse sets as soon as
the launcher sees a rank exit and any rank sets when its own collective fails; once it is set, the
wait raises within ``POLL_S``. The abandoned group cannot be destroyed by the rank's own thread: its
destructor joins its threads, which wait for the pending operation's timeout (measured: the next step
stalled for exactly the collective timeout, 30 s), and ``abort()`` does not shorten that wait on gloo
(torch 2.13: ``abort()`` returns at once, the destructor after it still waits the timeout). Kept alive
instead, each failed epoch's group kept its threads until the rank exited (some 2,800 a rank after 900
failed epochs). So ``retire`` keeps it for the collective timeout, when any operation
left pending on it has ended, then drops it in a thread of its own (``threading.Timer``): its threads end
then (``tests/unit/live/test_retire_group.py`` counts them), and the rank's own thread never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

POLL_S = 0.002

T = TypeVar("T")


class EpochAborted(RuntimeError):
    """The epoch's group is gone: a member died or its collective failed."""


def abort_key(epoch: int) -> str:
    return f"abort/{epoch}"


def end_epoch(store: dist.Store, epoch: int) -> None:
    store.set(abort_key(epoch), "1")


def leave_if_ended(store: dist.Store, epoch: int, doing: str) -> None:
    """``EpochAborted`` ("epoch N ended while this rank ``doing``") once ``epoch``'s abort key is set."""
    if store.check([abort_key(epoch)]):
        raise EpochAborted(f"epoch {epoch} ended while this rank {doing}")


def make_group(store: dist.TCPStore, epoch: int, index: int, size: int, timeout: timedelta,
               beat: Callable[[], None]) -> dist.ProcessGroup:
    """The epoch's gloo group, on the store prefix ``pg/<epoch>``. Its constructor connects to every
    member and blocks until they all have (up to ``timeout``): a member that died meanwhile (a second
    failure during a join) would keep this rank there, silent. So it is built ``watched``; an abandoned
    build ends on its own at ``timeout``. The build gets a store connection of its own: one client
    serialises its calls, and the build's blocking reads would hold up this rank's heartbeats behind them."""
    def build() -> dist.ProcessGroup:
        connection = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout)
        return dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{epoch}", connection), index, size, timeout)

    try:
        return watched(build, store, epoch, beat, "connected to its group")
    except EpochAborted:
        raise
    except Exception as error:
        raise RuntimeError(f"epoch {epoch}: its gloo group could not be built: {error}") from error


def retire(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Destroys a failed epoch's ``group`` once an operation left pending on it has timed out (its
    ``timeout``), in a timer's thread (the module's docstring). The caller drops its own reference now."""
    held = [group]
    timer = threading.Timer(timeout.total_seconds(), held.clear)
    timer.name, timer.daemon = "retired-group", True
    timer.start()


def arrive(store: dist.Store, prefix: str, index: int, size: int, epoch: int, beat: Callable[[], None],
           doing: str) -> None:
    """Every member of ``epoch``'s ``size`` at ``prefix`` before any goes on: this member's key set, the
    others' awaited by polling (``POLL_S``) while this rank beats and watches ``abort/<epoch>``. Not in a
    thread: an epoch that ends meanwhile (a member stopped or dead before it arrived) leaves nothing
    running behind, where a thread abandoned in a group's rendezvous lives on until its timeout and can
    still make a group after its rank has moved on. ``doing``: for the error, as ``watched``'s."""
    store.set(f"{prefix}/arrived/{index}", "1")
    everyone = [f"{prefix}/arrived/{member}" for member in range(size)]
    while not store.check(everyone):
        beat()
        leave_if_ended(store, epoch, doing)
        time.sleep(POLL_S)


def watched(work: Callable[[], T], store: dist.Store, epoch: int, beat: Callable[[], None], doing: str) -> T:
    """``work()``, run in a thread while this rank beats and watches ``abort/<epoch>``: its result, or its
    error raised here; ``EpochAborted`` as soon as the epoch ends (the thread is abandoned: blocked in a
    collective or a connection, it ends on its own at its timeout). ``doing``: for the error, "this rank
    <doing>"."""
    def ended() -> str | None:
        return f"epoch {epoch} ended while this rank {doing}" if store.check([abort_key(epoch)]) else None

    return watched_until(work, ended, beat, f"epoch-{epoch}-watched")


def watched_until(work: Callable[[], T], ended: Callable[[], str | None], beat: Callable[[], None], name: str) -> T:
    """``work()`` in a thread named ``name`` while this rank beats; ``EpochAborted`` with ``ended()``'s
    line as soon as it says something (polled every ``POLL_S``)."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # raised by the waiting thread (DCP's CheckpointException included)
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        beat()
        why = ended()
        if why is not None:
            raise EpochAborted(why)
        thread.join(POLL_S)
    done, value = outcome[0]
    if not done:
        raise value
    return value


def wait(work: dist.Work, store: dist.Store, epoch: int, beat: Callable[[], None]) -> None:
    """``beat``: this rank's heartbeat, so the lighthouse tells a waiting rank from a hung one."""
    while not work.is_completed():
        beat()
        leave_if_ended(store, epoch, "waited in a collective")
        time.sleep(POLL_S)
    work.wait()  # raises the collective's own error, if it failed


def wait_all(works: list[dist.Work], store: dist.Store, epoch: int, beat: Callable[[], None]) -> None:
    """``wait`` for works that say they are complete only once waited for (gloo's sends and receives):
    waited for in a thread, ``watched``."""
    def wait_each() -> None:
        for work in works:
            work.wait()

    watched(wait_each, store, epoch, beat, "waited in a send or receive")
