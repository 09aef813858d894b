"""The layers of ``trainguard`` (docs/architecture.md), checked on the source: every import of every
module, function-level ones included, goes to the same floor or a lower one, packages and modules import
each other without cycles, and no module uses another module's underscore names.

The checks parse the source with ``ast`` (nothing is imported), so they run in a fraction of a second
and a new upward import, cycle or private use anywhere fails the suite with the file and line.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first. A package may import its own floor and those below; "" is trainguard/__init__.py.
FLOORS: list[tuple[str, frozenset[str]]] = [
    ("ground: file-system primitives and layout names, errors, forking, the run secret",
     frozenset({"fs", "errors", "_lazy", "forking", "run_secret"})),
    ("topology, norms, events", frozenset({"topology", "norms", "events"})),
    ("guards: pure rules and their typed verdicts", frozenset({"guards"})),
    ("checkpoint tiers", frozenset({"checkpoint"})),
    ("backup, merge/convert, Hugging Face", frozenset({"backup", "merge", "hf"})),
    ("runtime: lifecycle, supervisor, live recovery; fault injection, node doctor, planning; the run configuration",
     frozenset({"runtime", "live", "faults", "doctor", "plan", "config"})),
    ("step API", frozenset({"step"})),
    ("trainer, demo, report, cli, integrations", frozenset(
        {"trainer", "demo", "report", "cli", "integrations", "__main__", ""})),
]


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # the imported module, dotted
    name: str | None = None  # ``from target import name``


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def modules(src: Path, root: str) -> dict[str, Path]:
    return {module_name(path, src): path for path in sorted((src / root).rglob("*.py"))}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def imports_of(name: str, path: Path, known: set[str], tree: ast.Module | None = None) -> list[Import]:
    """Every import statement of the module, wherever it stands (module level, function, class)."""
    found = []
    for node in ast.walk(tree or parse(path)):
        if isinstance(node, ast.Import):
            found += [Import(name, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package(path) else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:  # ``from package import module``
                    found.append(Import(name, node.lineno, submodule))
                else:
                    found.append(Import(name, node.lineno, target, alias.name))
    return found


def package_of(module: str, root: str) -> str | None:
    """``trainguard.checkpoint.local.tier`` -> ``checkpoint``; ``trainguard`` -> ``""``; None outside."""
    if module == root:
        return ""
    if not module.startswith(root + "."):
        return None
    return module.split(".")[1]


def floor_of(package: str) -> int | None:
    return next((i for i, (_, packages) in enumerate(FLOORS) if package in packages), None)


def layer_violations(src: Path, root: str = "trainguard") -> list[str]:
    """Upward imports, packages on no floor, and cycles between packages, one line each."""
    found = modules(src, root)
    known = set(found)
    problems = []
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for name, path in found.items():
        mine = package_of(name, root)
        if floor_of(mine) is None:
            problems.append(f"{path}: package {mine!r} is on no floor of the layer table")
            continue
        for imp in imports_of(name, path, known):
            theirs = package_of(imp.target, root)
            if theirs is None or theirs == mine:
                continue
            where = f"{path}:{imp.line}: {name} imports {imp.target}"
            if floor_of(theirs) is None:
                problems.append(f"{where}: package {theirs!r} is on no floor of the layer table")
            elif floor_of(theirs) > floor_of(mine):
                problems.append(f"{where}: {theirs!r} is on a higher floor ({FLOORS[floor_of(theirs)][0]}) "
                                f"than {mine!r} ({FLOORS[floor_of(mine)][0]})")
            edges[mine].setdefault(theirs, imp)
    problems += [f"import cycle between packages: {cycle}" for cycle in cycles(edges)]
    return problems


def cycles(edges: dict[str, dict[str, Import]]) -> list[str]:
    """One line per cycle found by a depth-first search, naming an import of each edge."""
    found, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == "open":
                loop = trail[trail.index(nxt):] + [node, nxt] if nxt in trail else [node, nxt]
                steps = [f"{a} -> {b} ({edges[a][b].module}:{edges[a][b].line})" for a, b in zip(loop, loop[1:])]
                found.append("; ".join(steps))
            elif nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


def module_cycles(src: Path, root: str = "trainguard") -> list[str]:
    """Cycles between modules (``hf.config`` <-> ``hf.init`` was one), one line each; importing a
    package's ``__init__`` from inside the package does not count (it runs first anyway)."""
    found = modules(src, root)
    known = set(found)
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for name, path in found.items():
        for imp in imports_of(name, path, known):
            target = imp.target
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and not name.startswith(target + "."):
                edges[name].setdefault(target, imp)
    return [f"import cycle between modules: {cycle}" for cycle in cycles(edges)]


def private_uses(src: Path, root: str = "trainguard") -> list[str]:
    """``from x import _name`` of another module, and ``module._name`` on a module imported by name."""
    found = modules(src, root)
    known = set(found)
    problems = []
    for name, path in found.items():
        tree = parse(path)
        imports = imports_of(name, path, known, tree)
        for imp in imports:
            if (imp.name and imp.name.startswith("_") and not imp.name.startswith("__")
                    and package_of(imp.target, root) is not None and imp.target != name):
                problems.append(f"{path}:{imp.line}: imports {imp.target}.{imp.name}, a private name of another module")
        bound = {}  # local names bound to trainguard modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in found:
                        bound[alias.asname] = alias.name
        for imp in imports:  # ``from package import module``
            if imp.name is None and imp.target in found and "." in imp.target:
                bound.setdefault(imp.target.rsplit(".", 1)[1], imp.target)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and bound[node.value.id] != name):
                problems.append(f"{path}:{node.lineno}: uses {bound[node.value.id]}.{node.attr}, a private name "
                                "of another module")
    return problems


# --------------------------------------------------------------------------------------- the real tree
def test_every_import_goes_down_or_across_and_packages_have_no_cycle():
    assert layer_violations(SRC) == []


def test_modules_import_each_other_without_cycles():
    assert module_cycles(SRC) == []


def test_no_module_uses_another_modules_private_names():
    assert private_uses(SRC) == []


# ------------------------------------------------------------------------- the checks on planted trees
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = tmp_path / "trainguard" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


CLEAN = {
    "__init__.py": "",
    "fs/__init__.py": "",
    "fs/fsio.py": "import os\n",
    "checkpoint/__init__.py": "",
    "checkpoint/commit.py": "from trainguard.fs.fsio import fsync_dir\n",
    "trainer/__init__.py": "",
    "trainer/loop.py": "from trainguard.checkpoint import commit\n",
}


def test_a_clean_planted_tree_passes(tmp_path):
    src = _tree(tmp_path, CLEAN)
    assert layer_violations(src) == []
    assert module_cycles(src) == []
    assert private_uses(src) == []


def test_a_planted_upward_import_fails_even_inside_a_function(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "checkpoint/commit.py": (
        "from trainguard.fs.fsio import fsync_dir\n\n\ndef commit():\n    from trainguard.trainer.loop import run\n")})
    upward, cycle = layer_violations(src)  # trainer imports checkpoint: the upward import closes a cycle too
    assert "checkpoint/commit.py:5: trainguard.checkpoint.commit imports trainguard.trainer.loop" in upward
    assert "'trainer' is on a higher floor" in upward
    assert cycle.startswith("import cycle between packages:") and "checkpoint -> trainer" in cycle


def test_a_planted_relative_upward_import_fails(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "fs/fsio.py": "from ..checkpoint import commit\n"})
    upward, _cycle = layer_violations(src)
    assert "trainguard.fs.fsio imports trainguard.checkpoint.commit" in upward


def test_a_planted_cycle_on_one_floor_fails(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "cli/__init__.py": "", "cli/main.py": "import trainguard.trainer.loop\n",
                           "trainer/entry.py": "from trainguard.cli.main import main\n"})
    (problem,) = layer_violations(src)
    assert problem.startswith("import cycle between packages:")
    assert "cli -> trainer" in problem and "trainer -> cli" in problem


def test_a_planted_cycle_between_modules_of_one_package_fails(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "checkpoint/manifest.py": "from trainguard.checkpoint import commit\n",
                           "checkpoint/commit.py": "def seal():\n    from trainguard.checkpoint.manifest import x\n"})
    assert layer_violations(src) == []
    (problem,) = module_cycles(src)
    assert "trainguard.checkpoint.commit -> trainguard.checkpoint.manifest" in problem


def test_a_planted_package_on_no_floor_fails(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "gadgets/__init__.py": "", "gadgets/x.py": "import trainguard.fs.fsio\n"})
    assert any("package 'gadgets' is on no floor" in problem for problem in layer_violations(src))


@pytest.mark.parametrize("text", [
    "from trainguard.fs.fsio import _secret\n",
    "from trainguard.fs import fsio\n\nfsio._secret()\n",
    "import trainguard.fs.fsio as fsio\n\nfsio._secret()\n",
])
def test_a_planted_private_use_fails(tmp_path, text):
    src = _tree(tmp_path, {**CLEAN, "checkpoint/commit.py": text})
    (problem,) = private_uses(src)
    assert "trainguard.fs.fsio._secret, a private name of another module" in problem
