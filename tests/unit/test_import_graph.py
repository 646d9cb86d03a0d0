"""The house by process (docs/architecture.md, "The rooms"): how rollflow's modules import each other.

Reads every module of ``rollflow/`` with ``ast`` (nothing is imported), imports at any depth of
the code included: a function-level import is still a dependency, only a later one.

- No import circles: a circle is two modules that can only be read, and moved, together.
- Rooms point one way: ``flows → services → tasks → infra``; the trainer's process
  (``rollflow/trainer/``) and vLLM's (``rollflow/inference/``) are reached from the others only
  through their contracts (``trainer/protocol.py``, ``inference/protocol.py``), so the run
  process never loads a rank's code (torch's distributed stack, DeepSpeed, peft) nor vLLM's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rollflow

ROOT = Path(rollflow.__file__).parent
CONTRACTS = {"rollflow.trainer.protocol", "rollflow.inference.protocol"}
# A room may import the rooms after it in this order, never one before it.
LAYERS = ["flows", "services", "tasks", "infra"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The rollflow modules ``path`` imports (``from a import b``: ``a.b`` where that is a
    module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
    return {name for name in found if name in MODULES and name != "rollflow"}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_the_graph_is_read():
    assert "rollflow.services.run_services" in GRAPH["rollflow.flows.rl_run"]
    assert len(GRAPH) > 100


def test_there_is_no_import_circle():
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check itself
    circles = _circles(GRAPH)
    assert not circles, "modules that import each other:\n" + "\n".join(map(str, circles))


def test_the_processes_of_the_trainer_and_of_vllm_are_reached_through_their_contracts():
    crossings = [
        f"{src} imports {dst}"
        for src, targets in sorted(GRAPH.items())
        for dst in sorted(targets)
        for room in ("trainer", "inference")
        if _room(dst) == room and _room(src) != room and dst not in CONTRACTS
    ]
    assert not crossings, "\n".join(crossings)


def test_the_contracts_import_no_process_code():
    for contract in CONTRACTS:
        assert {_room(m) for m in GRAPH[contract]} <= {"infra"}, GRAPH[contract]


def test_rooms_import_one_way():
    backwards = [
        f"{src} imports {dst}"
        for src, targets in sorted(GRAPH.items())
        for dst in sorted(targets)
        if _room(src) in LAYERS
        and _room(dst) in LAYERS
        and LAYERS.index(_room(dst)) < LAYERS.index(_room(src))
    ]
    assert not backwards, "\n".join(backwards)
