"""No stage imports another (docs/architecture.md): the flow hands one stage's service to another.

Reads each module of ``rollflow/tasks/<stage>/`` with ``ast`` (nothing is imported or started).
"""

import ast
from pathlib import Path

import rollflow.tasks

TASKS = Path(rollflow.tasks.__file__).parent
STAGES = sorted(p.name for p in TASKS.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def imported_stages(path: Path) -> set[str]:
    """The stages (``rollflow.tasks.<stage>``) a module imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["rollflow", "tasks"] and len(parts) > 2 and parts[2] in STAGES:
                found.add(parts[2])
    return found


def test_there_are_stages_to_check():
    assert {"generate", "advantage", "train", "sync"} <= set(STAGES)


def test_no_stage_imports_another():
    crossings = [
        f"{path.relative_to(TASKS.parent.parent)} imports rollflow.tasks.{other}"
        for stage in STAGES
        for path in sorted((TASKS / stage).rglob("*.py"))
        for other in sorted(imported_stages(path) - {stage})
    ]
    assert not crossings, "a stage imports another:\n" + "\n".join(crossings)
