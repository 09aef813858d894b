"""A plain ``pip install trainguard`` is whole: every third-party module the package imports outside an
``except ImportError`` fallback belongs to a distribution in ``[project].dependencies`` (matplotlib for
``trainguard report`` among them). ``trainguard.integrations`` is exempt: each adapter needs the framework
it adapts (extras ``hf``, ...)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "src" / "trainguard"
OPTIONAL_PACKAGES = {PACKAGE / "integrations"}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` whose handlers catch ImportError (or ModuleNotFoundError)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in {"ImportError", "ModuleNotFoundError"}
            or isinstance(h.type, ast.Tuple) and any(getattr(e, "id", "") in {"ImportError", "ModuleNotFoundError"}
                                                     for e in h.type.elts)
            for h in node.handlers):
            return True
    return False


def required_top_level_modules() -> dict[str, str]:
    """module -> the first file importing it unguarded."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(optional in path.parents for optional in OPTIONAL_PACKAGES):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if _guarded(node, parents):
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "trainguard" and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in project["dependencies"]}


def test_every_unguarded_import_is_a_declared_dependency():
    declared = declared_distributions()
    owners = packages_distributions()
    undeclared = {}
    for module, where in required_top_level_modules().items():
        distributions = {d.lower().replace("_", "-") for d in owners.get(module, [module])}
        if not distributions & declared:
            undeclared[module] = where
    assert not undeclared, f"imported but not in [project].dependencies: {undeclared}"


def test_the_report_plots_library_is_a_dependency():
    assert "matplotlib" in declared_distributions()
    assert required_top_level_modules().get("matplotlib") == "src/trainguard/report/plots.py"
