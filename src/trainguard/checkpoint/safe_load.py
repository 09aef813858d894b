"""Loading checkpoint files without running code from them.

``torch.load(weights_only=True)`` covers tensor files. DCP's ``.metadata`` is a plain pickle that DCP
itself reads with ``pickle.load``, which runs whatever the file names; here it is read with an
unpickler that resolves only the classes DCP actually writes into it.
"""

from __future__ import annotations

import importlib
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from trainguard.fs.fsio import PathLike
from trainguard.errors import CheckpointError, IncompatibleCheckpointError, UnsafeCheckpointError

DCP_METADATA_NAME = ".metadata"

# torch's weights-only unpickler warns (two lines) about a pickle protocol torch.save never writes just
# before it refuses such a file: a planted pickle's refusal is to be one line, not three.
warnings.filterwarnings("ignore", message=r"Detected pickle protocol \d+ in the checkpoint", category=UserWarning)

# What torch's own DCP writes (checked against saves of plain, nested, optimizer and DTensor state).
_DCP_METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a lookup of a layout by its name
    "torch": frozenset({"Size"}),
    # StorageMeta.checkpoint_id is the save's path (module "pathlib._local" from Python 3.13).
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
}

_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


DTENSOR_CLASS_NAMES = (
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",  # torch 2.10 on
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",  # torch 2.10 on
    "torch.distributed._mesh_layout._FlatLayout",  # in 2.13 and 2.14, not in 2.10
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types.Partial",
)
"""What a pickled DTensor names besides plain tensors: the class, its spec and mesh, the placements
(verl's rank files and the local tier's hold DTensors). Plain data classes: nothing runs code. Most are
private and come and go between torch releases: the allow-list holds those this torch has."""

DTENSOR_MODULES = frozenset(name.rpartition(".")[0] for name in DTENSOR_CLASS_NAMES)
"""The modules of the allow-list: the only ones a file's globals make us import (to tell a class this
torch lacks from one never allowed); any other module a file names is refused unimported."""


def resolve_global(name: str) -> Any:
    """The object a pickle's ``GLOBAL module.name`` names, or None where this torch has no such thing."""
    module, _, attribute = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return None


def _dtensor_classes() -> list[Any]:
    return [found for found in map(resolve_global, DTENSOR_CLASS_NAMES) if found is not None]


def _numpy_array_classes() -> list[Any]:
    """What a pickled numpy RNG state names (verl's extra state holds ``np.random.get_state()``: a uint32
    array): ``_reconstruct`` makes an empty array of the class it is given, and only ``ndarray`` is
    allowed; the array's bytes are data, and its dtype may only be uint32 (an object array, whose
    elements could name anything, is refused by its dtype class)."""
    import numpy

    allowed: list[Any] = [numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1 files
        try:
            allowed.append((importlib.import_module(module)._reconstruct, f"{module}._reconstruct"))
        except (ImportError, AttributeError):
            pass
    return allowed


def _globals_named(path: PathLike) -> list[str]:
    """The globals a ``torch.save`` file's pickle names; none for a file of another format (a bare
    pickle, say), which ``torch.load(weights_only=True)`` then refuses by what it would have run."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError):  # torch 2.13 raises ValueError for a file that is not torch.save's zip
        return []


def safe_torch_load(path: PathLike, *, mmap: bool = False) -> Any:
    """``torch.load`` to CPU with ``weights_only=True`` (DTensors and numpy arrays allowed: their classes
    hold data only);
    a file that would need to run code is refused with ``UnsafeCheckpointError``, an unreadable one with
    ``CheckpointError``, both naming it. ``torch.distributed.tensor`` (most of a second to import) is
    imported only for files that name it."""
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)  # "unpickling of the DeviceMesh before the PGs were created": expected
    try:
        named = _globals_named(path)
        # importing a module an untrusted file names runs that module's code: only the allow-list's own
        missing = [name for name in named
                   if name.rpartition(".")[0] in DTENSOR_MODULES and resolve_global(name) is None]
        if missing:
            raise IncompatibleCheckpointError(f"cannot load {path}: it names {missing[0]}, which torch "
                                              f"{torch.__version__} lacks")
        allowed = _dtensor_classes() if any(g.startswith("torch.distributed.") for g in named) else []
        if any(g.startswith("numpy.") for g in named):
            allowed += _numpy_array_classes()
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise weights_only_refusal(path, exc) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (RuntimeError, KeyError, EOFError, ValueError, OSError) as exc:
        # torch reports a truncated or foreign file as any of these.
        raise CheckpointError(f"cannot load {path}: {_first_line(exc)}") from None
    except (AttributeError, TypeError, ImportError) as exc:  # a class of this torch rebuilt from another's state
        raise IncompatibleCheckpointError(f"cannot load {path} under torch {torch.__version__}: "
                                          f"{describe_error(exc)}") from None
    finally:
        mesh_log.setLevel(level)


def weights_only_refusal(path: PathLike, exc: pickle.UnpicklingError) -> UnsafeCheckpointError:
    """The one line for a file ``torch.load(weights_only=True)`` refused, naming what it would have run."""
    offender = _UNSUPPORTED_GLOBAL.search(str(exc))
    detail = f" ({offender.group(1)})" if offender else ""
    return UnsafeCheckpointError(
        f"refusing to load {path}: it contains pickled code/objects that weights_only loading does not allow{detail}"
    )


class _DcpMetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: PathLike):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_CLASSES.get(module, ()) or (module == "torch" and _is_dtype_name(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to load {self._source}: it contains pickled code/objects that DCP metadata "
            f"never holds ({module}.{name})"
        )


def _is_dtype_name(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def load_dcp_metadata(path: PathLike) -> Metadata:
    """Reads a DCP ``.metadata`` file (or the one in checkpoint directory ``path``) without executing
    anything it names."""
    path = Path(path)
    if path.is_dir():
        path = path / DCP_METADATA_NAME
    try:
        with open(path, "rb") as f:
            metadata = _DcpMetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a damaged pickle fails in many ways; all mean "unreadable"
        raise CheckpointError(f"cannot load {path}: {describe_error(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"cannot load {path}: holds a {type(metadata).__name__}, not DCP Metadata")
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise CheckpointError(f"cannot load {path}: its storage table is a {type(storage).__name__}, not a mapping")
    for index, info in storage.items():
        _check_storage_file_name(path, index, getattr(info, "relative_path", None))
    return metadata


def _check_storage_file_name(path: Path, index: Any, name: Any) -> None:
    """DCP writes each shard beside ``.metadata`` under a bare file name; a name with a directory in it
    (``../../etc/shadow``) would make a reader open a file outside the checkpoint."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise CheckpointError(f"{path}: the storage entry of {getattr(index, 'fqn', index)} names {name!r}, "
                              "not a file of this checkpoint; refusing to read it")


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone when there is no message): one line."""
    text = _first_line(exc)
    return type(exc).__name__ if text == type(exc).__name__ else f"{type(exc).__name__}: {text}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
