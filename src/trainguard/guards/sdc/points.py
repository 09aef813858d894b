"""Detection points: where the checked gradients are taken, and one statistic per point per micro-batch.

Default points: every normalisation layer of the model (``nn.LayerNorm``, ``nn.RMSNorm`` and any
module whose class name ends in ``Norm``, e.g. Hugging Face's ``LlamaRMSNorm``), checked on the
gradient flowing into it, i.e. its ``grad_input`` (the gradient with respect to its input): a
forward pre-hook passes the module a view of its input and hooks that view's gradient (no change to
the model's code; cheaper than ``register_full_backward_hook``, whose Python autograd Function wraps
every input and output). Under FSDP2 the norm modules sit inside FSDP-wrapped blocks (or are wrapped
themselves) and their hooks work as usual.

Custom points, one line each:

- a module, by dotted name or object: ``points.add("model.embed_tokens")`` (or ``install(model,
  extra_points=["model.embed_tokens"])``, or the config's ``guards.sdc.points``). ``where`` picks the
  gradient: ``"grad_input"`` (the view's tensor hook, as for norms), ``"grad_output"`` (a tensor hook on each output,
  registered by a forward hook), or ``"auto"`` (default): ``grad_input``, unless none of the module's
  inputs has a gradient, then ``grad_output``, the gradient with respect to its output. ``auto`` on an
  ``nn.Embedding``/``nn.EmbeddingBag`` (whose input is integer ids) resolves to ``grad_output`` at
  once; on another module, a call whose inputs need no gradient is checked on its ``grad_output``;
- a tensor inside a forward: ``h = sdc.watch_tensor("embedding.gather", h)`` checks the gradient with
  respect to ``h`` (a tensor hook; a no-op while no DetectionPoints is installed);
- a tensor-producing function: ``gather = sdc.watch_function("embedding.gather", F.embedding)``
  checks the gradient with respect to every tensor the function returns (the reference's
  ``GatherASD``).

No host synchronisation per point: each hook computes its statistic (``"l2"``: the L2 norm, for rule
v1; ``"max_sq"``: ``max(g²)``, for rule v3) as a 0-d float32 tensor on the gradient's device and
copies it into a preallocated ``[points, micro_batches]`` buffer, one slot per point per micro-batch
(a point that fires more often, e.g. a module called twice per forward, takes more slots; the buffer
grows when needed). ``collect()`` returns the per-step ``[points]`` statistic (the maximum over the
slots, NaN propagating; ``NOT_CHECKED`` = -1 for a point that did not fire) and clears the buffer;
the trainer then reads the values with one ``.tolist()``.

The hooks never change a gradient, but a ``grad_input`` point adds a view node in front of the
module, so the gradient contributions to its input may be summed in another order: a run with norm
points matches one without them up to rounding, not always bit for bit (it is deterministic with
them). ``grad_output`` and tensor points add no node.
"""

from __future__ import annotations

import difflib
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from trainguard.errors import ConfigError
from trainguard.guards.sdc.detectors import NOT_CHECKED

STATISTICS = ("l2", "max_sq")
WHERE = ("auto", "grad_input", "grad_output")

PointSpec = str | nn.Module | tuple[str | nn.Module, str]

# the instance the one-liners report to; a weak reference, so that a dropped instance stops being active
_ACTIVE: weakref.ref[DetectionPoints] | None = None


def is_norm_module(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and any module whose class name ends in ``Norm`` (FSDP2's ``FSDPLayerNorm`` too)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


BLOCK_SUFFIXES = ("Layer", "Block")


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's transformer blocks: the members of an ``nn.ModuleList`` whose class name ends in
    ``Layer`` or ``Block`` (``LlamaDecoderLayer``, FSDP2's ``FSDPLlamaDecoderLayer``, ``GPT2Block``)."""
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for index, child in enumerate(module):
                if type(child).__name__.endswith(BLOCK_SUFFIXES):
                    blocks.append((f"{name}.{index}" if name else str(index), child))
    return blocks


def output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, module)`` of the model's output head (Hugging Face's ``get_output_embeddings()``, the
    ``lm_head``), or None for a model without one (a pipeline stage before the last)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return None
    return next(((name, module) for name, module in model.named_modules() if module is head), None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # the statistic is this rank's: its shard of a DTensor gradient
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _measured(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's parts of ``tensors`` that hold elements, detached."""
    return [part for part in (_local(t).detach() for t in tensors) if part.numel()]


def max_abs(tensor: torch.Tensor) -> torch.Tensor:
    """``max|g|`` as a 0-d float32 tensor (NaN propagates): one min/max pass, far cheaper on CPU than
    ``abs().amax()``, which writes a whole copy first."""
    low, high = torch.aminmax(tensor.reshape(-1))
    return torch.maximum(high, low.neg()).float()


def gradient_statistic(tensors: Sequence[torch.Tensor], statistic: str) -> torch.Tensor | None:
    """The statistic of several gradients taken together, as a 0-d float32 tensor (no host sync);
    None when there is nothing to measure. ``l2``: the norm of their concatenation; ``max_sq``: the
    largest square (``max|g|`` squared, equal to ``max(g²)`` in float32 and cheaper)."""
    if len(tensors) == 1 and type(tensors[0]) is torch.Tensor:  # the usual case, kept short: it runs per hook
        grad = tensors[0].detach()
        if not grad.numel():
            return None
        if statistic == "l2":
            return torch.linalg.vector_norm(grad, dtype=torch.float32)
        return max_abs(grad).square()
    local = _measured(tensors)
    if not local:
        return None
    if statistic == "l2":
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in local]
        return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    peaks = [max_abs(t).square() for t in local]
    return peaks[0] if len(peaks) == 1 else torch.stack(peaks).amax()


def peak_share(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The share of the gradients' squared L2 norm carried by their largest element, ``max(g²) / Σg²``
    (0 when every element is 0; meaningless when one is not finite, which the statistic itself shows),
    as a 0-d float32 tensor (no host sync).
    One bit flip that blows one element up makes it close to 1; a real gradient spike, spread over
    many elements, leaves it low."""
    local = _measured(tensors)
    if not local:
        return None
    total = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in local]).square().sum()
    peak = torch.stack([max_abs(t) for t in local]).amax().square()
    return torch.where(total > 0, peak / total, torch.zeros_like(total))


def _token_rows(tensor: torch.Tensor) -> torch.Tensor:
    """An activation gradient as rows of its last dimension (a token's features); a vector is one row."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(1, -1)


def _norm_and_isolated_share(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of the (local, non-empty) tensors taken together and their ``isolated_peak_share``,
    from one read of each (its rows' norms) plus its row of most energy; 0-d float32, no host sync.
    ``matrix_statistics`` reads weight gradients the same way, but batched for many tensors and with
    their row odds: for one activation gradient per hook its extra operations cost 40 µs more per
    point (98 against 59 µs at llama-60m's [1, 64, 768], fastest of 300)."""
    totals, largest, peaks, row_count = [], [], [], 0
    for tensor in tensors:
        rows = _token_rows(tensor)
        norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)
        top = norms.argmax().reshape(1)  # a NaN is the argmax: it reaches the peak and the share
        totals.append(torch.linalg.vector_norm(norms))
        largest.append(norms.index_select(0, top)[0])
        peaks.append(max_abs(rows.index_select(0, top)))
        row_count += rows.shape[0]
    if len(tensors) == 1:
        total, row, peak = totals[0], largest[0], peaks[0]
    else:
        total = torch.linalg.vector_norm(torch.stack(totals))
        which = torch.stack(largest).argmax().reshape(1)
        row, peak = torch.stack(largest).index_select(0, which)[0], torch.stack(peaks).index_select(0, which)[0]
    peak_sq, total_sq = peak.square(), total.square()
    rest = torch.maximum(total_sq - peak_sq, row_count * (row.square() - peak_sq)).clamp_min(0)
    share = peak_sq / (peak_sq + rest).clamp_min(torch.finfo(torch.float32).tiny)
    return total, torch.where(total_sq == 0, torch.zeros_like(share), share)  # a NaN stays NaN


def isolated_peak_share(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The peak share of activation gradients judged against its own row (rows: the last dimension, a
    token's features), as a 0-d float32 tensor (no host sync): with ``r`` the row of most energy, ``m``
    its largest ``|g|`` and ``R`` the number of rows, ``m² / (m² + max(Σg² − m², R · (|g_r|² − m²)))``:
    the rest of the point counts at least as much as it would if every row were like ``r``.
    One blown-up element dominates its row, so this is its plain share (``peak_share``), near 1 for a
    bit flip; an element that is large because its whole row is (a token whose gradient jumped, as
    clean activation gradients do: over 99 % of a norm input's energy in one token at times) gets its
    share of that row divided by about ``R``. 0 when every element is 0; NaN when one is NaN."""
    local = _measured(tensors)
    return _norm_and_isolated_share(local)[1] if local else None


def _statistic_and_share(tensors: Sequence[torch.Tensor], statistic: str) -> torch.Tensor | None:
    """``[statistic, isolated peak share]`` as one float32 tensor; for ``l2`` the norm comes from the
    same read of the rows as the share."""
    local = _measured(tensors)
    if not local:
        return None
    total, share = _norm_and_isolated_share(local)
    if statistic == "l2":
        return torch.stack([total, share])
    return torch.stack([torch.stack([max_abs(t) for t in local]).amax().square(), share])


class _Call:
    """One call of a grad_input point with several inputs: the gradients still to come, those in."""

    __slots__ = ("pending", "grads")

    def __init__(self, pending: int):
        self.pending = pending
        self.grads: list[torch.Tensor] = []


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


class DetectionPoints:
    """The detection points of one model (one pipeline stage), and their per-step statistics."""

    def __init__(self, statistic: str = "l2", micro_batches: int = 1, device: torch.device | str | None = None,
                 shares: bool = False):
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.statistic = statistic
        self.enabled = True  # hooks do nothing while False
        self._capacity = int(micro_batches)
        # also record each check's peak share (``isolated_peak_share``: the rules' peak criterion needs it)
        self.shares = bool(shares)
        self._device = torch.device(device) if device is not None else None
        self._names: list[str] = []
        self._where: dict[str, str] = {}
        self._index: dict[str, int] = {}
        self._fired: list[int] = []
        self._buffer: torch.Tensor | None = None
        self._handles: dict[str, list[RemovableHandle]] = {}
        self._fallback: set[int] = set()  # auto points whose current call has no input needing a gradient
        self._model: nn.Module | None = None

    # ------------------------------------------------------------------------------------- setup
    @property
    def names(self) -> list[str]:
        """The points in buffer order (``collect()[i]`` belongs to ``names[i]``)."""
        return list(self._names)

    def where(self, name: str) -> str:
        """``auto``, ``grad_input`` or ``grad_output`` for module points; ``tensor`` for tensor points."""
        return self._where[name]

    def install(self, model: nn.Module, extra_points: Iterable[PointSpec] = (), *, norms: bool = True,
                blocks: bool = False, lm_head: bool = False) -> list[str]:
        """Hooks every norm module of ``model`` (unless ``norms=False``), with ``blocks`` every
        transformer block's output gradient (``block_modules``), with ``lm_head`` the output head's
        output gradient (``output_head``: the logits' gradient), and each extra point: a dotted
        module name, a module object of ``model``, or ``(name or module, where)``. Installing again
        replaces every point. Makes this the active instance for ``watch_tensor``/``watch_function``.
        Returns ``names``. Raises ConfigError for an unknown module or a bad ``where``."""
        global _ACTIVE
        self.remove()
        self._model = model
        if self._device is None:
            parameter = next(model.parameters(), None)
            self._device = parameter.device if parameter is not None else torch.device("cpu")
        try:
            if norms:
                for name, module in model.named_modules():
                    if is_norm_module(module):
                        self._add_module(name or type(module).__name__, module, "auto")
            if blocks:  # the residual stream's gradient at each block's output
                for name, module in block_modules(model):
                    self._add_module(name, module, "grad_output")
            head = output_head(model) if lm_head else None
            if head is not None:
                self._add_module(*head, "grad_output")
            for spec in extra_points:
                target, where = spec if isinstance(spec, tuple) else (spec, None)
                self.add(target, where=where)
        except BaseException:
            self.remove()  # no half-installed hooks
            raise
        self._allocate()
        _ACTIVE = weakref.ref(self)
        return self.names

    def add(self, target: str | nn.Module, *, where: str | None = None, name: str | None = None) -> str:
        """Adds a module of the installed model as a detection point, by dotted name or object; returns
        the point's name. ``where``: ``"auto"`` (default), ``"grad_input"`` or ``"grad_output"``. A
        module that is already a point keeps its one point (an explicit ``where`` replaces the old)."""
        if where is not None and where not in WHERE:
            raise ConfigError(f"detection point {target!r}: where must be one of {', '.join(WHERE)}, got {where!r}")
        if self._model is None:
            raise ConfigError("detection points: call install(model) before adding module points")
        modules = dict(self._model.named_modules())
        if isinstance(target, str):
            if target not in modules:
                close = difflib.get_close_matches(target, list(modules), n=3)
                hint = f"did you mean {', '.join(map(repr, close))}?" if close else "see model.named_modules()"
                raise ConfigError(f"detection point {target!r}: the model has no module of that name ({hint})")
            module, point = modules[target], name or target
        elif isinstance(target, nn.Module):
            found = next((n for n, m in modules.items() if m is target), None)
            if found is None:
                raise ConfigError(f"detection point {type(target).__name__}: the module is not part of the installed model")
            module, point = target, name or found or type(target).__name__
        else:
            raise ConfigError(f"detection point {target!r}: expected a module name or an nn.Module")
        if point in self._where and self._where[point] == "tensor":
            raise ConfigError(f"detection point {point!r} is already a tensor point")
        if point in self._handles and where is None:
            return point
        self._add_module(point, module, where or "auto")
        self._allocate()
        return point

    def declare(self, name: str) -> int:
        """Declares a tensor point ahead of its first ``watch_tensor`` (so that ``names`` is complete
        before the first step); returns its index. Declaring twice is harmless."""
        if name in self._index:
            if self._where[name] != "tensor":
                raise ConfigError(f"detection point {name!r} is already a module point")
            return self._index[name]
        index = self._new_point(name, "tensor")
        self._allocate()
        return index

    def watch_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checks the gradient with respect to ``tensor`` (call it inside a forward); returns ``tensor``.
        A tensor that does not require grad (evaluation, ``no_grad``) is left alone."""
        if not self.enabled or not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
            return tensor
        index = self.declare(name)
        tensor.register_hook(functools.partial(self._tensor_hook, index))
        return tensor

    def watch_function(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped so that the gradient of every tensor it returns is checked as point ``name``."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            for tensor in _tensors(out):
                self.watch_tensor(name, tensor)
            return out

        return wrapped

    def remove(self) -> None:
        """Removes every hook and point (tensor hooks already registered on live tensors become no-ops)."""
        global _ACTIVE
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles = {}
        self._fallback = set()
        self._names, self._where, self._index, self._fired = [], {}, {}, []
        self._buffer = None
        self._model = None
        if active_points() is self:
            _ACTIVE = None

    # ------------------------------------------------------------------------------------- step
    def collect(self, with_shares: bool = False) -> torch.Tensor:
        """The step's statistic per point, ``[len(names)]`` float32 on the buffer's device: the maximum
        over the point's slots (micro-batches), NaN if any was NaN, ``NOT_CHECKED`` (-1) if the point
        did not fire. With ``with_shares`` (needs ``shares=True``): ``[2, len(names)]``, row 1 the
        largest peak share over the slots. Clears the buffer for the next step. No host synchronisation."""
        if with_shares and not self.shares:
            raise ValueError("collect(with_shares=True) needs DetectionPoints(shares=True)")
        if self._buffer is None:
            empty = torch.empty((2, 0) if with_shares else 0, dtype=torch.float32, device=self._device)
            return empty
        values = self._buffer.amax(dim=1)  # [points, planes]
        self.reset()
        return values.t() if with_shares else values[:, 0]

    def reset(self) -> None:
        """Forgets what the hooks recorded since the last ``collect()`` (e.g. a shape-inference backward)."""
        self._fired = [0] * len(self._names)
        if self._buffer is not None:
            self._buffer.fill_(NOT_CHECKED)

    @property
    def fired(self) -> list[int]:
        """How many times each point recorded a statistic since the last ``collect()``/``reset()``."""
        return list(self._fired)

    # ------------------------------------------------------------------------------------- internals
    def _new_point(self, name: str, where: str) -> int:
        index = len(self._names)
        self._names.append(name)
        self._where[name] = where
        self._index[name] = index
        self._fired.append(0)
        return index

    def _add_module(self, name: str, module: nn.Module, where: str) -> None:
        if where == "auto" and isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            where = "grad_output"  # its input is integer ids: resolved now, no input hook needed
        if name in self._handles:
            for handle in self._handles.pop(name):
                handle.remove()
            index = self._index[name]
            self._where[name] = where
        else:
            index = self._new_point(name, where)
        if where == "grad_output":
            # the gradient with respect to the output, through a tensor hook on each output
            self._handles[name] = [module.register_forward_hook(functools.partial(self._output_hook, index))]
            return
        # grad_input: a forward pre-hook puts a view (a C++ pass-through node) between the caller's
        # input and the module and hooks that view's gradient, which is then exactly the module's
        # grad_input. No Python autograd Function per call as register_full_backward_hook has (it
        # wraps every input and output in one, forward and backward): over 1.5x the cost per point.
        handles = [module.register_forward_pre_hook(functools.partial(self._input_hook, index, where))]
        if where == "auto":  # no input needs a gradient: check the output's (the pre-hook says so)
            handles.append(module.register_forward_hook(functools.partial(self._fallback_hook, index)))
        self._handles[name] = handles

    def _allocate(self) -> None:
        """Makes the buffer ``[len(names), capacity, planes]`` (plane 0 the statistic, plane 1 the peak
        share when recorded), keeping what it holds."""
        shape = (len(self._names), self._capacity, 2 if self.shares else 1)
        old = self._buffer
        if old is not None and old.shape == shape:
            return
        device = old.device if old is not None else (self._device or torch.device("cpu"))
        new = torch.full(shape, NOT_CHECKED, dtype=torch.float32, device=device)
        if old is not None:
            keep_rows, keep_cols = min(shape[0], old.shape[0]), min(shape[1], old.shape[1])
            new[:keep_rows, :keep_cols] = old[:keep_rows, :keep_cols]
        self._buffer = new

    def _record(self, index: int, tensors: Sequence[torch.Tensor]) -> None:
        if index >= len(self._fired):  # a tensor hook outliving remove()/install()
            return
        with torch.no_grad():
            stat = (_statistic_and_share(tensors, self.statistic) if self.shares
                    else gradient_statistic(tensors, self.statistic))
            if stat is None:
                return
        slot = self._fired[index]
        self._fired[index] = slot + 1
        if self._buffer is None or slot >= self._capacity:
            self._capacity = max(2 * self._capacity, slot + 1) if slot >= self._capacity else self._capacity
            self._allocate()
        assert self._buffer is not None
        if self._buffer.device != stat.device:  # the model moved after install: follow it, once
            self._buffer = self._buffer.to(stat.device)
        with torch.no_grad():
            self._buffer[index, slot] = stat  # a device-side copy

    def _input_hook(self, index: int, where: str, module: nn.Module, args: tuple) -> tuple | None:
        if not self.enabled:
            return None
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            if where == "auto":
                self._fallback.add(index)
            return None
        # several inputs: their gradients arrive one by one and are measured together, as one
        # grad_input (the statistic of their concatenation)
        call = _Call(len(positions)) if len(positions) > 1 else None
        args = list(args)
        for i in positions:
            view = args[i].view_as(args[i])
            view.register_hook(functools.partial(self._input_grad_hook, index, call))
            args[i] = view
        return tuple(args)

    def _input_grad_hook(self, index: int, call: _Call | None, grad: torch.Tensor) -> None:
        if not self.enabled:
            return
        if call is None:
            self._record(index, [grad])
            return
        call.grads.append(grad)  # held until the call's last input gradient: they come from one node
        call.pending -= 1
        if call.pending == 0:
            self._record(index, call.grads)

    def _fallback_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if index in self._fallback:
            self._fallback.discard(index)
            self._output_hook(index, module, args, output)

    def _output_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self.enabled:
            return
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._tensor_hook, index))

    def _tensor_hook(self, index: int, grad: torch.Tensor) -> None:
        if self.enabled:
            self._record(index, [grad])


# ------------------------------------------------------------------------- parameter gradient points
GRADIENT_PREFIX = "grad:"
# below this many elements a gradient may legitimately sit in one element (a norm's weight, a bias):
# the peak criterion gets no share for such a point (measured: benchmarks/sdc_coverage.py)
PEAK_MIN_ELEMENTS = 4096
ROW_ODDS_MAX = 1e30  # row odds are capped here (one row holding everything gives 1/0): a finite number to store


def _as_rows(grad: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The gradient as a matrix whose rows are the layer's output channels: the first dimension, more
    dimensions flattened; with ``transposed`` (a matrix stored ``[in, out]`` like Hugging Face's
    ``Conv1D``) its columns."""
    return grad.t() if transposed else grad.reshape(grad.shape[0], -1)


def matrix_statistics(grads: Sequence[torch.Tensor], transposed: Sequence[bool]) -> tuple[torch.Tensor, ...]:
    """For each gradient (two dimensions or more), from one read of it, its rows' L2 norms: its L2 norm,
    ``max|g|`` over its row with the most energy, and its row odds (``row_odds``); three float32 tensors
    of ``[len(grads)]``, no host sync. The row's ``max|g|`` is the gradient's own whenever that element
    carries more than half of the energy (its row then carries more than half, and is the largest), and
    never more than it: the peak share it gives is exact above 1/2 and at most the true one below.
    The few operations per gradient matter on a short CPU step: everything else is done for all at once."""
    norms, largest, lows, highs = [], [], [], []
    for grad, columns in zip(grads, transposed):
        matrix = _as_rows(grad, columns)
        rows = torch.linalg.vector_norm(matrix, dim=1, dtype=torch.float32)
        norms.append(torch.linalg.vector_norm(rows))
        largest.append(rows.amax())
        low, high = torch.aminmax(matrix.index_select(0, rows.argmax().reshape(1)))
        lows.append(low)
        highs.append(high)
    norms_t = torch.stack(norms)
    peaks = torch.maximum(torch.stack(highs), torch.stack(lows).neg()).float()
    top = torch.stack(largest).square()
    rest = (norms_t.square() - top).clamp_min(torch.finfo(torch.float32).tiny)
    odds = torch.where(top > 0, (top / rest).clamp(max=ROW_ODDS_MAX), torch.zeros_like(top))
    return norms_t, peaks, odds


def row_odds(grad: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """A weight gradient's largest row's squared L2 norm over the other rows' together,
    ``max_r |g_r|² / (|g|² − max_r |g_r|²)`` (rows: a layer's output channels, the first dimension; with
    ``transposed``, a matrix stored ``[in, out]`` like Hugging Face's ``Conv1D``, the second), as a 0-d
    float32 tensor (no host sync; 0 for an all-zero gradient, at most ``ROW_ODDS_MAX``). A flipped
    element of the layer's output gradient ``g[t, j]`` adds ``flip · x_t`` to row ``j`` of ``Σ_t g_t x_tᵀ``
    alone, so its odds jump, while a clean gradient's energy moves between rows by much less."""
    return matrix_statistics([grad], [transposed])[2][0]


# modules whose weight is stored [in_features, out_features] (Hugging Face's GPT-2 Conv1D): their
# output channels are the columns
TRANSPOSED_LINEAR = ("Conv1D",)


def _embedding_weights(model: nn.Module) -> set[int]:
    """The ids of the model's embedding tables (input and output): their rows are tokens, not output
    channels, and a batch's tokens put its gradient's energy in a few rows of them legitimately."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    output = getattr(model, "get_output_embeddings", None)
    head = output() if callable(output) else None
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        tables.add(id(head.weight))
    return tables


def shard_layout(parameter: torch.Tensor) -> str:
    """``[2048, 64] of [4096, 64] on mesh [2] at [1] (Shard(dim=0),)`` for a DTensor, ``[4096, 64]`` for
    a plain tensor: the part of the parameter this rank holds, which its gradient's statistics describe."""
    if not isinstance(parameter, DTensor):
        return str(list(parameter.shape))
    mesh = parameter.device_mesh
    return (f"{list(parameter.to_local().shape)} of {list(parameter.shape)} on mesh {list(mesh.shape)} "
            f"at {mesh.get_coordinate()} {tuple(parameter.placements)}")


class GradientPoints:
    """One detection point per parameter, on its gradient as the optimizer will see it (after the
    backward's reduction: under FSDP2 this rank's shard of the reduce-scattered gradient). Read once
    per step after backward: ``collect()`` stacks the statistics on the device, no host sync."""

    def __init__(self, model: nn.Module, statistic: str = "l2", shares: bool = False, rows: bool = False):
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
        self.statistic = statistic
        self.shares = bool(shares)
        # also record each weight matrix's row odds (``row_odds``: the rules' row criterion needs it)
        self.rows = bool(rows)
        self._parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # what each point measures: this rank's shard of the parameter (its shape, the whole's, its place
        # in the mesh), so that a detector keyed by it starts afresh when the sharding changes
        self.layouts = [shard_layout(p) for _, p in self._parameters]
        tables = _embedding_weights(model)
        # the parameters that get row odds: matrices (or more dimensions, flattened after the first) of
        # at least 2 rows, embedding tables left out
        self._with_rows = [p.dim() >= 2 and p.shape[0] >= 2 and id(p) not in tables for _, p in self._parameters]
        # the parameters measured by rows when the row odds are collected (embedding tables too: their
        # norm and peak share come from their rows' energies, though their odds are not recorded)
        self._by_rows = [p.dim() >= 2 for _, p in self._parameters]
        transposed = {id(m.weight) for m in model.modules()
                      if type(m).__name__ in TRANSPOSED_LINEAR and isinstance(getattr(m, "weight", None), torch.Tensor)}
        self._transposed = [p.dim() == 2 and id(p) in transposed for _, p in self._parameters]
        # (gradient, L2 norm of its local part) of the last collect, for the global norm to reuse
        # (``norms.KnownNorms``: one read of the gradients less); cleared by ``forget``
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forget(self) -> None:
        """Drops the last collect's norms (and with them the old gradients): call before a new backward."""
        self.norms = []

    @property
    def names(self) -> list[str]:
        return [GRADIENT_PREFIX + name for name, _ in self._parameters]

    def collect(self, with_shares: bool = False, with_rows: bool = False) -> torch.Tensor:
        """``[len(names)]`` float32, ``NOT_CHECKED`` for a parameter without a gradient or with an empty
        shard; with ``with_shares`` and/or ``with_rows``, ``[1 + with_shares + with_rows, len(names)]``:
        the statistic, then the peak shares, then the row odds (``row_odds``; ``NOT_CHECKED`` for a
        parameter that gets none). With the row odds (and the ``l2`` statistic), one read of each matrix:
        its rows' norms give its norm, its odds and its peak share (taken on its largest row:
        ``matrix_statistics``); otherwise fused per-tensor norms and one min/max pass per
        gradient. The norms are kept in ``norms`` for the global norm, which then reads the gradients no
        more (a matrix's norm from its rows may differ from ``torch._foreach_norm``'s in the last bits)."""
        if with_shares and not self.shares:
            raise ValueError("collect(with_shares=True) needs GradientPoints(shares=True)")
        if with_rows and not self.rows:
            raise ValueError("collect(with_rows=True) needs GradientPoints(rows=True)")
        originals = [p.grad for _, p in self._parameters]
        grads = [None if g is None else _local(g).detach() for g in originals]
        present = [i for i, g in enumerate(grads) if g is not None and g.numel()]
        self.norms = []
        device = grads[present[0]].device if present else torch.device("cpu")
        out = torch.full((1 + with_shares + with_rows, len(grads)), NOT_CHECKED, dtype=torch.float32, device=device)
        if not present:
            return out if with_shares or with_rows else out[0]
        with torch.no_grad():
            # one read of each matrix when the rows are wanted: its rows' norms give its norm, its row
            # odds and (from its largest row) its peak share; one fused norm pass and one min/max pass
            # for the rest (``max_sq`` needs every gradient's exact max|g|)
            by_rows = [i for i in present if self._by_rows[i]] if with_rows and self.statistic == "l2" else []
            norms_of: dict[int, torch.Tensor] = {}
            peaks_of: dict[int, torch.Tensor] = {}
            odds_of: dict[int, torch.Tensor] = {}
            if by_rows:
                measured = matrix_statistics([grads[i] for i in by_rows], [self._transposed[i] for i in by_rows])
                for statistics, into in zip(measured, (norms_of, peaks_of, odds_of)):
                    into.update(zip(by_rows, statistics.unbind()))
            rest = [i for i in present if i not in norms_of]
            if rest:
                norms_of.update(zip(rest, torch._foreach_norm([grads[i] for i in rest])))
            self.norms = [(originals[i], norms_of[i]) for i in present]
            norms = torch.stack([norms_of[i].float() for i in present])
            index = torch.tensor(present, device=device)
            if self.statistic == "l2" and not self.shares:
                out[0, index] = norms
            else:
                peaks = torch.stack([peaks_of[i] if i in peaks_of else max_abs(grads[i]) for i in present]).square()
                out[0, index] = norms if self.statistic == "l2" else peaks
                if with_shares:
                    shares = torch.where(norms > 0, peaks / norms.square().clamp_min(
                        torch.finfo(torch.float32).tiny), torch.zeros_like(norms))
                    large = torch.tensor([grads[i].numel() >= PEAK_MIN_ELEMENTS for i in present], device=device)
                    out[1, index] = torch.where(large, shares, torch.full_like(shares, NOT_CHECKED))
            matrices = [i for i in present if self._with_rows[i]]
            if with_rows and matrices:
                out[-1, torch.tensor(matrices, device=device)] = torch.stack(
                    [odds_of[i] if i in odds_of else row_odds(grads[i], self._transposed[i]) for i in matrices])
        return out if with_shares or with_rows else out[0]


# --------------------------------------------------------------------- the active instance (one-liners)
def active_points() -> DetectionPoints | None:
    """The DetectionPoints installed last (None when none is, or it was removed or dropped)."""
    return _ACTIVE() if _ACTIVE is not None else None


def watch_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, its gradient checked as point ``name`` by the active DetectionPoints (if any)."""
    points = active_points()
    return points.watch_tensor(name, tensor) if points is not None else tensor


def watch_function(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so that, whenever a DetectionPoints is active at call time, the gradient of every
    tensor it returns is checked as point ``name``. Wrap at model construction, before ``install``."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        points = active_points()
        if points is not None:
            for tensor in _tensors(out):
                points.watch_tensor(name, tensor)
        return out

    return wrapped
