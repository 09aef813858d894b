"""Public names of a package imported from its submodules on first use (PEP 562).

Importing any submodule runs its package's ``__init__`` first; with eager re-exports, reading one small
file (``group_info.json``) would import every sibling module and, through them, ``torch.distributed``
(about a second before any command could start).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``exports`` maps submodule -> public names."""
    where = {name: submodule for submodule, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        submodule = where.get(name)
        if submodule is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{submodule}"), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
