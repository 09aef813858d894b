"""``ckpt test``: a merged Hugging Face directory against a reference, tensor by tensor.

The reference is another Hugging Face directory or a trainguard checkpoint (durable, local or
verl-style), which is read through the same plan as a merge with the target's config, so names
match. Values are compared with tolerances by dtype (``torch.testing``'s defaults).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from trainguard.errors import ConfigError
from trainguard.hf.fused_experts import StoredTensor
from trainguard.merge.hf_layout import is_value_config, load_config, plan_merge
from trainguard.merge.pieces import assemble
from trainguard.merge.safetensors_out import INDEX_FILE, SINGLE_FILE
from trainguard.merge.source import open_checkpoint
from trainguard.merge.split_experts import stored_layout

# (rtol, atol) by dtype: torch.testing.assert_close's defaults
TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5),
              torch.bfloat16: (1.6e-2, 1e-5)}


@dataclass(frozen=True)
class LazyTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Difference:
    name: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:<8} {self.name}: {self.detail}"


def is_hf_directory(directory: Path) -> bool:
    return (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file()


def hf_tensors(directory: Path) -> dict[str, LazyTensor]:
    if (directory / INDEX_FILE).is_file():
        files = sorted(set(json.loads((directory / INDEX_FILE).read_text())["weight_map"].values()))
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise ConfigError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (not a Hugging Face model directory)")
    out: dict[str, LazyTensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ConfigError(f"{path}: missing (named by {INDEX_FILE})")
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                                        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                                        "BOOL": "bool"}[sl.get_dtype()])
                out[key] = LazyTensor(tuple(sl.get_shape()), dtype, _safetensors_loader(path, key))
    return out


def _safetensors_loader(path: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key)
    return load


def reference_tensors(reference: Path, target: Path) -> dict[str, LazyTensor]:
    if is_hf_directory(reference):
        return hf_tensors(reference)
    config = load_config(target)
    plan = plan_merge(open_checkpoint(reference), config, tie=False, value_model=is_value_config(config))
    layout = stored_layout(config["model_type"], plan.outputs)  # fused experts: as the merge writes them

    @functools.lru_cache(maxsize=2)  # the per-expert tensors of a layer's two fused tensors come in turns
    def full(i: int) -> torch.Tensor:
        return assemble(plan.outputs[i][1])

    def load(i: int, part: StoredTensor) -> torch.Tensor:
        tensor = full(i)
        return tensor[part.block(tensor.dim())].reshape(part.shape)

    return {part.name: LazyTensor(part.shape, tensor.dtype, functools.partial(load, i, part))
            for i, ((_, tensor), parts) in enumerate(zip(plan.outputs, layout)) for part in parts}


def compare_tensors(target: dict[str, LazyTensor], reference: dict[str, LazyTensor]) -> tuple[int, list[Difference]]:
    """Returns (tensors compared, differences); missing keys on either side are differences too."""
    differences = [Difference(n, "missing", "in the reference, not in the target") for n in reference if n not in target]
    differences += [Difference(n, "extra", "in the target, not in the reference") for n in target if n not in reference]
    compared = 0
    for name, mine in target.items():
        theirs = reference.get(name)
        if theirs is None:
            continue
        compared += 1
        if mine.shape != theirs.shape:
            differences.append(Difference(name, "shape", f"{list(mine.shape)} vs reference {list(theirs.shape)}"))
            continue
        if mine.dtype != theirs.dtype:
            differences.append(Difference(name, "dtype", f"{mine.dtype} vs reference {theirs.dtype}"))
        a, b = mine.load(), theirs.load().to(mine.dtype)
        rtol, atol = TOLERANCES.get(mine.dtype, (0.0, 0.0))
        if a.is_floating_point():
            close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        else:
            close = a == b
        if not bool(close.all()):
            bad = int((~close).sum())
            worst = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
            differences.append(Difference(name, "values", f"{bad} of {a.numel()} elements differ beyond "
                                          f"rtol={rtol} atol={atol} (max abs difference {worst:.3g})"))
        del a, b
    return compared, differences
