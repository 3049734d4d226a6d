"""The largest modules, classes and functions of the package, in lines (an ``ast`` walk over
every folder pyproject.toml maps to an ``autopar`` package; a function's lines run from its
``def`` or first decorator to its last line, docstring included; methods count as functions,
named ``Class.method``).

    python benchmarks/hub_sizes.py                 # this checkout, the 10 largest of each
    python benchmarks/hub_sizes.py --root DIR --top 20 --match planner/
"""
from __future__ import annotations

import argparse
import ast
import tomllib
from pathlib import Path


def package_files(root: Path) -> list[Path]:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    folders = {root / f for f in config["tool"]["setuptools"]["package-dir"].values()}
    # the root package's folder holds only its own modules (cli.py, __init__.py); the others, their
    # sub-packages too (simulator/device, axes, step)
    return sorted({f for d in folders for f in (d.glob("*.py") if d == root else d.rglob("*.py"))})


def sizes(root: Path) -> tuple[list, list, list]:
    """(modules, classes, functions): (lines, name) each."""
    modules, classes, functions = [], [], []
    for file in package_files(root):
        rel = file.relative_to(root).as_posix()
        text = file.read_text()
        modules.append((len(text.splitlines()), rel))
        tree = ast.parse(text, filename=rel)

        def visit(node, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    entry = (child.end_lineno - start + 1, f"{rel}:{prefix}{child.name}")
                    (classes if isinstance(child, ast.ClassDef) else functions).append(entry)
                    visit(child, f"{prefix}{child.name}.")

        visit(tree, "")
    return tuple(sorted(x, key=lambda e: (-e[0], e[1])) for x in (modules, classes, functions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout (default: this one)")
    parser.add_argument("--top", type=int, default=10, help="rows of each table (default 10)")
    parser.add_argument("--match", default="", help="only names containing this (e.g. planner/)")
    args = parser.parse_args()
    for title, rows in zip(("modules", "classes", "functions"), sizes(args.root)):
        rows = [r for r in rows if args.match in r[1]][:args.top]
        print(f"largest {title}:")
        for n, name in rows:
            print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
