"""The house rules of docs/architecture.md, read from the code's own imports: dependencies point one way
(every import, lazy ones included, goes to a package on the same floor or below), no import circles of any
kind (module-level, type-only under ``TYPE_CHECKING``, and lazy imports inside functions all count), and a
module past ~800 lines is worth a look (a warning: size is a smell, never a reason to split one idea)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LARGE = 800  # lines: past this, ask whether a module holds two ideas

# the floor of each package (and of the modules at the root); a module may import its own floor and the floors below
FLOORS = {
    "sp_diffusers.parallel": 0,  # the SP core: attention, exchange, ring, masks, agreement, mesh, ...
    "sp_diffusers.families": 0,  # facts about diffusers model families
    "sp_diffusers.patching": 1,  # install() and what it applies: the backend's registration, patches, CP plans
    "sp_diffusers.tiny": 2,
    "sp_diffusers": 2,  # the package's face: lazy re-exports only
    "sp_diffusers.engine": 3,
    "sp_diffusers.flowgrpo": 4,  # the trainer
    "sp_diffusers.integrations": 5,
    "sp_diffusers.planner": 5,
    "sp_diffusers.demo": 5,
    "sp_diffusers.cli": 6,
}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    base = root / "sp_diffusers"  # the patches too: sp_diffusers/patching/patches/ (the top-level `patches` links there)
    for path in base.rglob("*.py"):
        parts = path.relative_to(base).with_suffix("").parts
        out[".".join(("sp_diffusers", *parts)).removesuffix(".__init__")] = path
    return out


def _floor(name: str) -> int:
    best = max((k for k in FLOORS if name == k or name.startswith(k + ".")), key=len)
    return FLOORS[best]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Every sp_diffusers module ``name`` imports: at module level, under TYPE_CHECKING, or inside a function."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: list[str] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [prefix]
        targets += [f"{prefix}.{a.name}" for a in node.names]
        return [t for t in targets if t in modules]

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.extend(resolve(node))
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name in modules)
    return found


def _graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """(import graph, the imports that point up a floor)."""
    modules = _modules(root)
    upward = []
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            if target == name:
                continue
            if _floor(target) > _floor(name):
                upward.append(f"{name} (floor {_floor(name)}) imports {target} (floor {_floor(target)})")
            # a package importing its own submodules is its face, not a circle
            if not target.startswith(name + "."):
                graph.setdefault(name, set()).add(target)
    return graph, upward


def test_dependencies_point_down_and_there_are_no_circles():
    graph, upward = _graph()
    assert not upward, "imports that point up:\n" + "\n".join(upward)
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


def test_type_only_and_lazy_circles_are_circles(tmp_path):
    files = {
        "__init__.py": "",
        "engine/__init__.py": "from .a import A\n",  # the package's face: not a circle
        "engine/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nclass A: ...\n",
        "engine/b.py": "from .a import A\nclass B: ...\n",
        "engine/c.py": "def f():\n    from . import d\n",
        "engine/d.py": "from .c import f\n",
    }
    for relative, text in files.items():
        path = tmp_path / "sp_diffusers" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph, upward = _graph(tmp_path)
    assert not upward
    assert sorted(_cycles(graph)) == [
        "sp_diffusers.engine.a -> sp_diffusers.engine.b -> sp_diffusers.engine.a",
        "sp_diffusers.engine.c -> sp_diffusers.engine.d -> sp_diffusers.engine.c",
    ]


def test_large_modules_are_named():
    """Not a cap: each module past LARGE lines is named in a warning, for whoever reads it next."""
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in _modules().values()}
    for path, n in sorted(sizes.items()):
        if n > LARGE:
            warnings.warn(f"{path}: {n} lines; does it hold two ideas?", stacklevel=1)
    assert sizes, "no module found"
