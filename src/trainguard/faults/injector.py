"""Fires parsed faults at the trainer's hook points: step start, module hooks, after backward, after commit."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from trainguard.errors import ConfigError
from trainguard.faults.bits import flip_bit
from trainguard.faults.files import DAMAGE, matching_files
from trainguard.faults.ledger import FiredLedger
from trainguard.faults.spec import DOCTOR_KINDS, FILE_KINDS, FaultSpec, parse_faults

ENV_VAR = "TRAINGUARD_FAULTS"

logger = logging.getLogger(__name__)


def active_faults(config_text: str | None) -> tuple[str, list[FaultSpec]]:
    """The faults in force and where they came from: ``TRAINGUARD_FAULTS`` wins over the config."""
    env_text = os.environ.get(ENV_VAR)
    if env_text and env_text.strip():
        source, text = ENV_VAR, env_text
    else:
        source, text = "config key 'faults'", config_text
    try:
        return source, parse_faults(text)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # a rank can only corrupt what it holds: its shard of a DTensor
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def check_fault_ranks(specs: list[FaultSpec], world_size: int) -> None:
    """Refuses a fault naming a rank the run does not have (checked before launch and by each rank)."""
    for spec in specs:
        if spec.rank is not None and spec.rank >= world_size and spec.kind not in DOCTOR_KINDS:
            raise ConfigError(
                f"bad fault {spec.text!r}: rank {spec.rank} is outside the world size {world_size}"
                f" (ranks 0..{world_size - 1})"
            )


def check_wipe_nodes(specs: list[FaultSpec], nodes: int | None) -> None:
    """Refuses a ``wipe`` of a node the run does not have (``nodes``: the local tier's nodes, ``world //
    parallel.ranks_per_node``), or any when the local tier is off (``nodes`` None): nothing to wipe."""
    for spec in specs:
        if spec.kind != "wipe":
            continue
        if nodes is None:
            raise ConfigError(f"bad fault {spec.text!r}: the local tier is off (set checkpoint.local_interval)")
        if spec.params["node"] >= nodes:
            raise ConfigError(f"bad fault {spec.text!r}: node {spec.params['node']} does not exist "
                              f"(nodes 0..{nodes - 1}; see parallel.ranks_per_node)")


class FaultInjector:
    """Injects the faults meant for this rank; a no-op at every step where none is due."""

    def __init__(self, specs: list[FaultSpec], run_dir: Path, rank: int, world_size: int, emit: Callable[..., Any],
                 once_per_run: bool = True):
        check_fault_ranks(specs, world_size)
        # True: a fault fires once in the run, whatever restarts (the ledger's claim); False: at its step
        # each time that step is computed (live mode's gradient faults: a redone step is hit again, as
        # the data of that step would be)
        self.once_per_run = once_per_run
        self.specs = list(specs)
        self.rank = rank
        self.world_size = world_size
        self._emit = emit
        self._ledger = FiredLedger(Path(run_dir), rank)
        from trainguard.runtime.heartbeat import node_name

        node = node_name()  # node=NAME: only on that node (a supervisor's simulated node, or a host name)
        mine = [spec for spec in specs
                if (spec.rank is None or spec.rank == rank) and spec.params.get("node", node) == node]
        self._step_faults = [spec for spec in mine if spec.kind in ("kill", "hang")]
        self._gradient_faults = [spec for spec in mine if spec.kind in ("spike", "nan")]
        self._site_faults = [spec for spec in mine if spec.kind in ("bitflip", "scale")]
        self._state_faults = [spec for spec in mine if spec.kind == "stateflip"]
        self._file_faults = [spec for spec in mine if spec.kind in FILE_KINDS]
        self._wipe_faults = [spec for spec in specs if spec.kind == "wipe"]
        self._step: int | None = None
        self._handles: list[RemovableHandle] = []
        self._reproduce: dict[int, int] = {}  # nan faults: the step each fired at in this process

    @classmethod
    def from_env(
        cls, run_dir: Path, rank: int, world_size: int, emit: Callable[..., Any], config_text: str | None = None
    ) -> "FaultInjector":
        """Faults from ``TRAINGUARD_FAULTS`` when it is set and not blank, else from ``config_text``."""
        source, specs = active_faults(config_text)
        try:
            return cls(specs, Path(run_dir), rank, world_size, emit)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    @property
    def active(self) -> bool:
        return bool(self.specs)

    def install(self, model: torch.nn.Module) -> None:
        """Registers the hooks of this rank's bitflip/scale faults; calling it again replaces them."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        parameters = dict(model.named_parameters())
        for spec in self._state_faults:
            site = spec.params["site"]
            if site not in parameters:
                close = difflib.get_close_matches(site, list(parameters), n=3)
                hint = f"did you mean {', '.join(map(repr, close))}?" if close else "see model.named_parameters()"
                raise ConfigError(f"bad fault {spec.text!r}: the model has no parameter {site!r} ({hint})")
        if not self._site_faults:
            return
        modules = dict(model.named_modules())
        for spec in self._site_faults:
            site = spec.params["site"]
            if site not in modules:
                close = difflib.get_close_matches(site, list(modules), n=3)
                hint = f"did you mean {', '.join(map(repr, close))}?" if close else "see model.named_modules()"
                raise ConfigError(f"bad fault {spec.text!r}: the model has no module {site!r} ({hint})")
            if spec.params["where"] == "output":
                handle = modules[site].register_forward_hook(self._output_hook(spec))
            else:
                handle = modules[site].register_full_backward_hook(self._grad_input_hook(spec))
            self._handles.append(handle)

    def at_step_start(self, step: int) -> None:
        """Remembers the step for the module hooks, then kills or hangs this process if that is due."""
        self._step = step
        for spec in self._step_faults:
            if not self._due(spec, step):
                continue
            if spec.kind == "kill":
                self._report(spec, step, action="SIGKILL", pid=os.getpid())
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                seconds = spec.params["seconds"]
                self._report(spec, step, action="hang", seconds=seconds)
                self._hang(seconds)

    def at_rest(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                wait_for_staging: Callable[[], object] | None = None) -> None:
        """Flips a bit of a parameter or of its Adam moment (this rank's shard), if a stateflip is due:
        call it between two steps, where the state rests in memory. ``wait_for_staging``: the checkpoint
        manager's, called before the first flip: the lazy copy of the save just made must hold the state
        of its step, so that a drill recomputes from the same checkpoint whenever that copy runs."""
        waited = False
        for spec in self._state_faults:
            if not self._due(spec, step):
                continue
            if wait_for_staging is not None and not waited:
                wait_for_staging()
                waited = True
            site, state = spec.params["site"], spec.params["state"]
            parameter = dict(model.named_parameters())[site]
            if state == "weight":
                tensor = parameter
            else:
                moments = optimizer.state.get(parameter, {}) if optimizer is not None else {}
                if state not in moments:
                    logger.warning("fault %r: parameter %s has no %s yet (before the first step)", spec.text, site, state)
                    self._report(spec, step, site=site, state=state, flipped=False)
                    continue
                tensor = moments[state]
            local = _local(tensor.detach())
            if local.numel() == 0:
                self._report(spec, step, site=site, state=state, flipped=False)
                continue
            try:
                flip = flip_bit(local, min(spec.params["index"], local.numel() - 1), spec.params["bit"])
            except ValueError as error:
                raise ConfigError(f"bad fault {spec.text!r}: {error}") from None
            self._report(spec, step, site=site, state=state, flipped=True, dtype=str(local.dtype),
                         **dataclasses.asdict(flip))

    def after_backward(self, step: int, model: torch.nn.Module) -> None:
        """Spikes every gradient (each rank its shard) or plants a NaN, if that is due."""
        for spec in self._gradient_faults:
            # a planted NaN models one from the data or the math: it comes back on a rerun of its step
            reproduced = spec.kind == "nan" and self._reproduce.get(spec.index) == step
            if not reproduced and not self._due(spec, step):
                continue
            if spec.kind == "nan":
                self._reproduce[spec.index] = step
            if spec.kind == "spike":
                self._spike(spec, step, model)
            else:
                self._plant_nan(spec, step, model)

    def after_commit(self, step: int, checkpoint_dir: Path) -> None:
        """Damages files of the checkpoint just committed for ``step``, if that is due."""
        checkpoint_dir = Path(checkpoint_dir)
        for spec in self._file_faults:
            if not self._due(spec, step):
                continue
            paths = matching_files(checkpoint_dir, spec.params["file"])
            if not paths:
                logger.warning("fault %r matched no file in %s", spec.text, checkpoint_dir)
            files = [path.relative_to(checkpoint_dir).as_posix() for path in paths]
            changes = [{"file": file, **DAMAGE[spec.kind](path)} for file, path in zip(files, paths)]
            self._report(spec, step, checkpoint=str(checkpoint_dir), files=files, changes=changes)

    def wipe_due(self, step: int) -> bool:
        """Whether a wipe is planned after ``step`` (the same answer on every rank, fired or not)."""
        return any(spec.step == step for spec in self._wipe_faults)

    def check_nodes(self, nodes: int | None) -> None:
        """Refuses wipes of nodes that do not exist; ``None``: the local tier is off, nothing to wipe."""
        check_wipe_nodes(self._wipe_faults, nodes)

    def after_local_save(self, step: int, node: int, first_on_node: bool, node_dirs: list[Path]) -> None:
        """Deletes this node's whole local directory if a wipe of it is due (done by the node's first rank;
        the caller holds every rank at a barrier around this call)."""
        for spec in self._wipe_faults:
            if spec.params["node"] != node or not first_on_node or not self._due(spec, step):
                continue
            removed = []
            for directory in node_dirs:
                if directory.exists():
                    shutil.rmtree(directory)
                    removed.append(str(directory))
            self._report(spec, step, node=node, removed=removed)

    def _due(self, spec: FaultSpec, step: int | None) -> bool:
        # the step comparisons come first so that hooks cost two integer tests on ordinary steps
        if step is None or step < spec.step:
            return False
        if spec.persistent:
            return True
        return step == spec.step and (not self.once_per_run or self._ledger.claim(spec, step))

    def _report(self, spec: FaultSpec, step: int | None, **details: Any) -> None:
        logger.warning("injecting fault %r at step %s: %s", spec.text, step, details)
        self._emit("fault_injected", step, fault=spec.kind, spec=spec.text, fault_index=spec.index, **details)

    @staticmethod
    def _hang(seconds: float | None) -> None:
        if seconds is not None:
            time.sleep(seconds)
            return
        while True:
            time.sleep(3600)

    def _spike(self, spec: FaultSpec, step: int, model: torch.nn.Module) -> None:
        factor = spec.params["factor"]
        gradients = 0
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    _local(parameter.grad).mul_(factor)
                    gradients += 1
        self._report(spec, step, factor=factor, gradients=gradients)

    def _plant_nan(self, spec: FaultSpec, step: int, model: torch.nn.Module) -> None:
        for name, parameter in model.named_parameters():
            if parameter.grad is None:
                continue
            gradient = _local(parameter.grad)
            if gradient.numel() == 0:  # an FSDP shard can be empty on ranks past the end of a small tensor
                continue
            with torch.no_grad():
                gradient[(0,) * gradient.dim()] = float("nan")
            self._report(spec, step, parameter=name, index=0)
            return
        logger.warning("fault %r: no parameter on rank %d has a gradient to set to NaN", spec.text, self.rank)
        self._report(spec, step, parameter=None)

    def _output_hook(self, spec: FaultSpec) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if not self._due(spec, self._step):
                return None
            return self._corrupt_first_tensor(spec, output)

        return hook

    def _grad_input_hook(self, spec: FaultSpec) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> Any:
            if not self._due(spec, self._step):
                return None
            return self._corrupt_first_tensor(spec, grad_input)

        return hook

    def _corrupt_first_tensor(self, spec: FaultSpec, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._corrupt(spec, value)
        if isinstance(value, (tuple, list)):
            for position, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    items = list(value)
                    items[position] = self._corrupt(spec, item)
                    return type(value)(items)
        raise ConfigError(
            f"bad fault {spec.text!r}: module {spec.params['site']!r} has no tensor {spec.params['where']} to change"
        )

    def _corrupt(self, spec: FaultSpec, tensor: torch.Tensor) -> torch.Tensor:
        # a copy, because the original may be saved for backward or shared with another tensor; the
        # change is made outside autograd so gradients flow as if the wrong value had been computed
        changed = tensor.clone()
        local = _local(changed)
        if spec.kind == "scale":
            with torch.no_grad():
                local.mul_(spec.params["factor"])
            details: dict[str, Any] = {"factor": spec.params["factor"]}
        else:
            try:
                details = dataclasses.asdict(flip_bit(local, spec.params["index"], spec.params["bit"]))
            except ValueError as error:
                raise ConfigError(f"bad fault {spec.text!r}: {error}") from None
        self._report(
            spec, self._step, module=spec.params["site"], where=spec.params["where"], dtype=str(local.dtype), **details
        )
        return changed
