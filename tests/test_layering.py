"""The package graph: imports go one way, down (docs/architecture.md, "Layers").

Every `import` and `from ... import` under loom/ counts, inside functions and under
`if TYPE_CHECKING:` too: an import hidden in a function to dodge a cycle is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

LOOM = Path(__file__).resolve().parent.parent / "loom"

# Lowest first. A unit (a top-level module or a subpackage of loom) may import units of
# lower layers only: not its own layer's other units, never a higher one.
LAYERS: list[set[str]] = [
    {"errors", "hugepages", "paths"},   # hugepages: huge-page buffers (numpy only); paths: LOOM_CACHE
    {"eviction_params"},            # KV eviction settings, held by sampling_params and config
    {"sampling_params", "config", "outputs"},
    {"contracts"},
    {"kernels", "loader", "kv", "sample"},
    {"structured"},
    {"model"},
    {"speculative"},
    {"engine"},
    {"parallel"},
    {"llm"},
    {"server"},
    {"cluster"},                    # Ray Serve deployments around the server's app
    {"bench", "eval"},
    {"cli"},
    {"__main__", "__init__"},       # `python -m loom`; the package's lazy public names
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit_of_file(path: Path) -> str:
    rel = path.relative_to(LOOM)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _imported_units(node: ast.AST) -> list[str]:
    """The loom units an import statement reaches (`from loom import kernels` reaches kernels)."""
    if isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "loom":
            mods = [f"loom.{a.name}" for a in node.names]
        else:
            mods = [node.module]
    else:
        return []
    return [m.split(".")[1] for m in mods if m.startswith("loom.")]


def import_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the places ("file:line") that import it."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(LOOM.rglob("*.py")):
        src = _unit_of_file(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for dst in _imported_units(node):
                if dst != src:
                    graph[src][dst].append(f"{path.relative_to(LOOM.parent)}:{node.lineno}")
    return graph


def test_every_unit_has_a_layer():
    units = {_unit_of_file(p) for p in LOOM.rglob("*.py")}
    assert units - LAYER_OF.keys() == set(), "add the new package or module to LAYERS"


def test_imports_only_go_down():
    upward = [f"{src} -> {dst} ({', '.join(places)})"
              for src, targets in import_graph().items() for dst, places in targets.items()
              if LAYER_OF[dst] >= LAYER_OF[src]]
    assert upward == []


def test_no_package_cycle():
    graph = {src: set(targets) for src, targets in import_graph().items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                pytest.fail("package cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The graph counts an import placed inside a function."""
    tree = ast.parse("def f():\n    from loom.engine.engine import Engine\n")
    assert [u for node in ast.walk(tree) for u in _imported_units(node)] == ["engine"]


def test_the_http_front_end_imports_neither_torch_nor_the_engine():
    """`loom serve`'s front end process (the CLI, the app, the engine-process client) starts
    without torch: the engine process imports it, in parallel (docs/architecture.md, "Start
    and stop")."""
    code = ("import sys, loom.cli, loom.server.serve, loom.server.openai_api; "
            "print(sorted(m for m in ('torch', 'loom.engine.engine', 'loom.model', 'loom.kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=LOOM.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
