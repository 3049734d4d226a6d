"""List public top-level names (functions, classes, assignments) defined in more than one package module.

Usage: ``python tools/twice_defined.py`` from the repository root; prints ``name: module, module, ...``
for each name defined at the top level of two or more modules of the package (core, planner,
simulator, runtime, report, profiling and the root modules), then how many there are.
A name imported from another module is not a definition; ``main`` (every CLI module's entry)
and ``add_arguments`` (its flags) are left out: one meaning in every CLI module.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("core", "planner", "simulator", "runtime", "report", "profiling", "elastic")
IGNORED = {"main", "add_arguments"}          # every CLI module's entry and its flags: one meaning each


def package_modules(root: Path) -> list[Path]:
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    return files + sorted(p for p in root.glob("*.py"))


def public_definitions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if not n.startswith("_") and n not in IGNORED}


def twice_defined(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in package_modules(root):
        for name in public_definitions(path):
            where[name].append(str(path.relative_to(root)))
    return {n: sorted(ms) for n, ms in sorted(where.items()) if len(ms) > 1}


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    found = twice_defined(root)
    for name, modules in found.items():
        print(f"{name}: {', '.join(modules)}")
    print(f"{len(found)} public names defined in more than one package module")
