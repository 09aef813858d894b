"""A live run's fault drill in the faults grammar (docs/faults.md): ``kill:rank=R,step=S`` entries, in
the config key ``faults`` or in ``TRAINGUARD_FAULTS`` (which wins, as everywhere), make the live
launcher SIGKILL rank R once it has committed S steps (the steps ``guard.steps`` yields, counted from 0:
as it starts step S). Several entries are one node's ranks hit together, so they share one step.

A ``miscompute`` entry (the doctor's fault, docs/faults.md) acts in the warm spares' self-test
(``spare_check``), ``rank=`` naming the spare: that spare is found unhealthy and never used.

The gradient faults ``spike`` and ``nan`` (``spike:step=N[,factor=F][,persistent=1]``, ``nan:step=N``)
are the ranks' own: each rank applies them to step N's summed gradient (the step that makes N committed
steps, as the closure mode numbers it), before the guards judge it, every time that step is computed
(``gradient_faults``). The sum is every rank's alike, so the fault is too: one narrowed to a node
(``node=``) is refused, and a ``nan``'s ``rank=`` changes nothing (a NaN in one rank's share of the
closure mode's all-reduce is in everyone's sum too).

The module faults ``bitflip`` and ``scale`` (``scale:rank=R,step=N,site=MODULE,where=grad_input,factor=F``)
are rank R's own, as in the closure mode: a wrong value at a module in the first micro-batch rank R
computes of step N, once in the run (``site_faults``; a transient miscompute, which SDC detection's rerun
finds, ``live/sdc.py``); so is ``stateflip`` (a bit of a parameter or an Adam moment flipped at rest,
before step N: replica fingerprints find it, ``live/fingerprint.py``), and so is ``hang``
(``hang:rank=R,step=N[,seconds=X]``: rank R stops, alive and silent, as it starts step N, for X seconds or
for good, once in the run): the closure mode's supervisor finds it by its heartbeat and restarts the job;
here the lighthouse finds it (the stall watch, then ``fault_tolerance.hang_s``), the survivors go on
without its group, and the launcher kills and replaces it, as a SIGSTOPped rank (with FSDP2, its group's
other ranks, waiting in FSDP2's collectives until then, end with exit 20 and start again with it).

The checkpoint file faults ``corrupt``, ``truncate`` and ``delete`` (``corrupt:step=N,file=GLOB``) damage the
durable checkpoint of step N once it is committed, as in the closure mode: the quorum's first member
applies them (the checkpoint manager's commit hook), and a later resume (``--resume auto``) passes the
damaged checkpoint over for the newest one that verifies.

The local tier's ``wipe`` (``wipe:node=N,step=S``) deletes node N's whole local directory after the
local save of step S, as in the closure mode: node N is the local tier's (``rank //
parallel.ranks_per_node``), its first member of the quorum deletes, every member held at a barrier around
it (``LiveCheckpoints``); refused when the local tier is off or node N does not exist. A job resumed
from the local tier then has the node's ranks receive their files from replicas of their shards
(``live/local_tier.py``).

So a live run drills every kind of the faults grammar. The launcher injects the kill, not the rank: the
keys that narrow a kill (``persistent``, ``node``) are refused, with one line naming the entry, by the
launcher and by each rank, never ignored.
"""

from __future__ import annotations

import dataclasses

from trainguard.errors import ConfigError
from trainguard.faults.injector import active_faults, check_fault_ranks, check_wipe_nodes
from trainguard.faults.spec import FILE_KINDS, FaultSpec

LIVE_FAULT_KIND = "kill"
GRADIENT_FAULT_KINDS = ("spike", "nan")  # applied by every rank to a step's summed gradient
# one rank's own: a module's value (its first micro-batch of the step), a state tensor at rest before the step,
# the rank itself stopped as it starts the step
SITE_FAULT_KINDS = ("bitflip", "scale", "stateflip", "hang")
CHECKPOINT_FAULT_KINDS = FILE_KINDS  # a committed durable checkpoint's files, by its quorum's first member
SPARE_FAULT_KIND = "miscompute"  # the doctor's fault: acts in the spares' self-tests (``spare_check``)
WIPE_FAULT_KIND = "wipe"  # a node's local directory deleted after a local save, by its first member


def local_tier_nodes(local_interval: int, ranks_per_node: int | None, world: int) -> int | None:
    """The local tier's nodes (``parallel.ranks_per_node`` consecutive ranks each, the last one maybe fewer; one
    node when unset); None when the local tier is off: what a ``wipe`` is checked against."""
    return -(-world // (ranks_per_node or world)) if local_interval else None


def live_drill(faults: str | None, world: int, steps: int, spares: int | None = None, *,
               local_nodes: int | None = None) -> dict[str, object]:
    """``LiveRun``'s fault fields for the faults in force (``faults``: the config key's text): none,
    ``kill_ranks`` and ``kill_at_step``, ``spare_faults`` (``miscompute`` entries, ``rank=`` naming a
    spare; checked against ``spares`` when the caller knows them); a ``ConfigError`` naming the source
    and the entry otherwise. ``local_nodes``: the local tier's nodes (``local_tier_nodes``), which a
    ``wipe`` must name one of (None: the local tier is off, a ``wipe`` is refused)."""
    source, specs = active_faults(faults)
    kills = [spec for spec in specs if spec.kind == LIVE_FAULT_KIND]
    try:
        check_wipe_nodes(specs, local_nodes)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    for spec in site_faults(faults):
        if "node" in spec.params and spec.kind != WIPE_FAULT_KIND:  # a wipe's node is the local tier's index
            raise ConfigError(f"{source}: fault {spec.text!r}: a live run's {spec.kind} names its rank; leave out node=")
        if not 0 < spec.step <= steps:
            raise ConfigError(f"{source}: fault {spec.text!r}: step must be between 1 and train.steps = {steps}")
    for spec in gradient_faults(faults):
        if "node" in spec.params:
            raise ConfigError(f"{source}: fault {spec.text!r}: a live run's {spec.kind} hits the step's summed "
                              "gradient on every rank alike; leave out node=")
        if not 0 < spec.step <= steps:
            raise ConfigError(f"{source}: fault {spec.text!r}: step must be between 1 and train.steps = {steps}")
    spare_faults = [spec for spec in specs if spec.kind == SPARE_FAULT_KIND]
    for spec in spare_faults:
        if spares is not None and (spares == 0 or (spec.rank is not None and spec.rank >= spares)):
            raise ConfigError(f"{source}: fault {spec.text!r}: in a live run, {SPARE_FAULT_KIND} acts in the warm "
                              f"spares' self-test and rank= names a spare; this run has {spares} spares "
                              "(fault_tolerance.spares)")
    try:
        check_fault_ranks([*kills, *site_faults(faults)], world)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    for spec in kills:
        if spec.persistent or spec.params:
            raise ConfigError(f"{source}: fault {spec.text!r}: a live run's kill takes rank and step only (no "
                              "persistent, no node): it fires once, the launcher's SIGKILL")
        if not 0 < spec.step < steps:
            raise ConfigError(f"{source}: fault {spec.text!r}: step must be between 1 and train.steps - 1 = "
                              f"{steps - 1} (a live run's kill comes after a committed step and before the last)")
    if len({spec.step for spec in kills}) > 1:
        raise ConfigError(f"{source}: faults {'; '.join(spec.text for spec in kills)!r}: a live run's kills hit "
                          "their ranks together (a node's), so they name one step")
    drill: dict[str, object] = {}
    if kills:
        drill.update(kill_ranks=tuple(dict.fromkeys(spec.rank for spec in kills)), kill_at_step=kills[0].step)
    if spare_faults:
        drill["spare_faults"] = "; ".join(spec.text for spec in spare_faults)
    return drill


def gradient_faults(faults: str | None) -> tuple[FaultSpec, ...]:
    """The ``spike`` and ``nan`` entries of the faults in force (``faults``: the config key's text), each
    for every rank (a ``nan``'s ``rank=`` dropped: every rank holds the sum it hits)."""
    return tuple(dataclasses.replace(spec, rank=None) for spec in active_faults(faults)[1]
                 if spec.kind in GRADIENT_FAULT_KINDS)


def site_faults(faults: str | None) -> tuple[FaultSpec, ...]:
    """The ``bitflip``, ``scale``, ``stateflip`` and ``hang`` entries of the faults in force (``faults``: the config
    key's text), the checkpoint file faults (``corrupt``, ``truncate``, ``delete``) and ``wipe``: the rank's fault
    injector's."""
    kinds = (*SITE_FAULT_KINDS, *CHECKPOINT_FAULT_KINDS, WIPE_FAULT_KIND)
    return tuple(spec for spec in active_faults(faults)[1] if spec.kind in kinds)
