"""The planner is pure: no module of ``autooffload.plan`` imports ``autooffload.runtime``."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import autooffload.plan

PLAN_DIR = Path(autooffload.plan.__file__).parent
PLAN_MODULES = sorted(
    f"autooffload.plan.{info.name}" for info in pkgutil.iter_modules([str(PLAN_DIR)])
)


def _imported_names(tree: ast.AST) -> list[str]:
    """Every module an ``import`` statement names, at any depth (function bodies and
    ``if TYPE_CHECKING:`` blocks included)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_importing_every_plan_module_imports_no_runtime_module():
    code = (
        "import importlib, sys\n"
        f"for name in {PLAN_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('autooffload.runtime')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert PLAN_MODULES and result.stdout.strip() == "[]", result.stdout


def test_no_plan_module_names_the_runtime_in_an_import_statement():
    offenders = [
        f"{path.name}: {name}"
        for path in sorted(PLAN_DIR.glob("*.py"))
        for name in _imported_names(ast.parse(path.read_text()))
        if name == "autooffload.runtime" or name.startswith("autooffload.runtime.")
    ]
    assert offenders == [], offenders
