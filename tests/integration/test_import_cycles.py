"""No import cycles among autopar's modules, nor among its packages.

The import graph is read from the source (an ``ast`` walk over every folder pyproject.toml maps
to an ``autopar`` package, imports inside functions included), so a lazy import that closes a
loop counts as one: a cycle makes two modules one unit that cannot be read, tested or moved
apart.  Packages are checked as well as modules, since ``a.x -> b`` and ``b.y -> a.z`` is a loop
between the two packages even when no module loop exists.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]


def _package_folders(root: Path) -> dict[str, Path]:
    """``autopar`` package name -> its folder, as pyproject.toml's package-dir maps them."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return {name: root / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for each package's folder and its sub-packages (folders with an
    ``__init__.py`` that no other package maps)."""
    mods: dict[str, Path] = {}
    mapped = {folder.resolve() for folder in packages.values()}

    def walk(pkg: str, folder: Path) -> None:
        for file in sorted(folder.glob("*.py")):
            mods[pkg if file.name == "__init__.py" else f"{pkg}.{file.stem}"] = file
        for sub in sorted(folder.iterdir()):
            if sub.is_dir() and (sub / "__init__.py").exists() and sub.resolve() not in mapped:
                walk(f"{pkg}.{sub.name}", sub)

    for pkg, folder in packages.items():
        walk(pkg, folder)
    return mods


def import_graph(packages: dict[str, Path]) -> nx.DiGraph:
    """Module -> module edges for every import between the given packages' modules."""
    mods = _modules(packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for mod, file in mods.items():
        pkg = mod if file.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts) + (f".{base}" if base else "")
                for alias in node.names:
                    targets.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    # ``import a.b.c`` imports a, a.b and a.b.c
                    parts = alias.name.split(".")
                    targets += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            graph.add_edges_from((mod, t) for t in targets if t in mods and t != mod)
    return graph


def package_graph(graph: nx.DiGraph, packages: dict[str, Path]) -> nx.DiGraph:
    """Package -> package edges implied by the module edges (a module belongs to the longest
    package name that prefixes it)."""
    names = sorted(packages, key=len, reverse=True)

    def owner(mod: str) -> str:
        return next(p for p in names if mod == p or mod.startswith(p + "."))

    out = nx.DiGraph()
    out.add_edges_from((owner(a), owner(b)) for a, b in graph.edges if owner(a) != owner(b))
    return out


def _cycles(graph: nx.DiGraph) -> list[str]:
    return [" -> ".join(c + [c[0]]) for c in nx.simple_cycles(graph)]


def test_no_module_import_cycle():
    packages = _package_folders(ROOT)
    assert _cycles(import_graph(packages)) == []


def test_no_package_import_cycle():
    packages = _package_folders(ROOT)
    assert _cycles(package_graph(import_graph(packages), packages)) == []


def test_the_check_sees_a_lazy_cycle_and_a_package_cycle(tmp_path):
    """The detector itself: a lazy import inside a function closes a module loop, and two
    packages that import each other through different modules form a package loop."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "x.py").write_text("from .y import f\n")
    (tmp_path / "a" / "y.py").write_text("def f():\n    from pkg.a import x\n    return x\n")
    (tmp_path / "a" / "z.py").write_text("import pkg.b.w\n")
    (tmp_path / "b" / "__init__.py").write_text("")
    (tmp_path / "b" / "w.py").write_text("from pkg.a.y import f\n")
    packages = {"pkg.a": tmp_path / "a", "pkg.b": tmp_path / "b"}
    graph = import_graph(packages)
    assert _cycles(graph) in (["pkg.a.x -> pkg.a.y -> pkg.a.x"], ["pkg.a.y -> pkg.a.x -> pkg.a.y"])
    assert sorted(package_graph(graph, packages).edges) == [("pkg.a", "pkg.b"), ("pkg.b", "pkg.a")]


def verb_importers(graph: nx.DiGraph, packages: dict[str, Path]) -> list[str]:
    """``importer -> verb`` for every import of a ``*_cli`` module (a verb: flags in, printing
    out) by a package module other than the command line's ``autopar.cli``, which registers
    them; a module of the library (``autopar.plan``, ``simulate``, ``report``, ``run_launch``...)
    is what a verb and any other module share.  Calls of ``importlib.import_module`` with a
    verb's name count too."""
    mods = _modules(packages)
    verbs = {m for m in mods if m.rsplit(".", 1)[-1].endswith("_cli")}
    out = [f"{a} -> {b}" for a, b in graph.edges if b in verbs and a != "autopar.cli"]
    for mod, file in mods.items():
        if mod == "autopar.cli":
            continue
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in verbs:
                out.append(f"{mod} -> {node.value} (by name)")
    return sorted(out)


def test_only_the_command_line_imports_a_verb():
    packages = _package_folders(ROOT)
    graph = import_graph(packages)
    assert verb_importers(graph, packages) == []
    # the rule reads the edges it is meant to see: cli.py names every verb module it registers
    # (by string, through importlib), and a planner module importing a verb would be caught
    from autopar.cli import VERBS

    mods = _modules(packages)
    assert {module for module, _ in VERBS.values()} <= {m for m in mods if m.endswith("_cli")}
    graph.add_edge("autopar.planner.trial_steps", "autopar.runtime.run_cli")
    assert verb_importers(graph, packages) == ["autopar.planner.trial_steps -> autopar.runtime.run_cli"]


def test_the_planner_reaches_the_simulator_through_api_only():
    """The planner imports one module of the simulator, simulator/api.py (docs/design.md, "Its
    rooms"), lazy imports inside functions included."""
    graph = import_graph(_package_folders(ROOT))
    reached = {b for a, b in graph.edges
               if (a == "autopar.planner" or a.startswith("autopar.planner."))
               and (b == "autopar.simulator" or b.startswith("autopar.simulator."))}
    assert reached == {"autopar.simulator.api"}
