"""Count how far the parallel axes are spread over the package's code.

Usage: ``python tools/axis_census.py [ROOT]`` (ROOT: a checkout of the repository, default this
one).  Over the modules of core/, planner/, simulator/ and runtime/, read as code (``ast``:
docstrings and comments are not code), it prints:

* the files that name an axis (``dp``, ``tp``, ``pp``, ``cp`` or the borrowed degree ``ep``) in
  code: an attribute ``x.dp``, a keyword ``dp=``, or a string constant ``"dp"``;
* the files that read ``mesh.<axis>`` (an attribute of a name or attribute called ``mesh``);
* the places that multiply the data-parallel and context-parallel degrees themselves: a ``*``
  whose two sides name ``dp`` and ``cp`` (``mesh.dp * mesh.cp``, ``dp * cp``, ``c["dp"] * self.cp``).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

DIRS = ("core", "planner", "simulator", "runtime")
AXES = ("dp", "tp", "pp", "cp", "ep")


def _names(node: ast.AST) -> set[str]:
    """The axis names a sub-expression mentions (as a name, an attribute or a string key)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in AXES:
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and n.attr in AXES:
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and n.value in AXES:
            out.add(n.value)
    return out


def census(path: Path) -> tuple[bool, bool, list[int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = reads_mesh = False
    products = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in AXES:
            names = True
            v = n.value
            if (isinstance(v, ast.Name) and v.id == "mesh") or (isinstance(v, ast.Attribute) and v.attr == "mesh"):
                reads_mesh = True
        elif isinstance(n, ast.keyword) and n.arg in AXES:
            names = True
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in AXES:
            names = True
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            left, right = _names(n.left), _names(n.right)
            if ("dp" in left and "cp" in right) or ("cp" in left and "dp" in right):
                products.append(n.lineno)
    return names, reads_mesh, products


def main(root: Path) -> None:
    files = sorted(p for d in DIRS for p in (root / d).rglob("*.py"))
    naming, mesh_reads, products = [], [], []
    for p in files:
        a, b, c = census(p)
        rel = str(p.relative_to(root))
        naming += [rel] if a else []
        mesh_reads += [rel] if b else []
        products += [f"{rel}:{line}" for line in c]
    print(f"files in {', '.join(DIRS)}: {len(files)}")
    print(f"files naming an axis in code: {len(naming)}")
    print(f"files reading mesh.<axis>: {len(mesh_reads)}")
    print(f"places multiplying dp x cp: {len(products)}" + (f" ({', '.join(products)})" if products else ""))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
