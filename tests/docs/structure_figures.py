"""The package's structure in figures, for reviews of a restructure:

    python tests/docs/structure_figures.py [--rev REV] [--json]

prints, for the working tree or a git revision: the modules over 400 lines, the longest functions, the
import circles inside each package, the source files that name a control event (the transitions the plan
decides), and the modules a resume's imports reach from `rewind.tools.train_cmd`. Read from the code's own
`ast`, nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("states", "stores", "engine", "kernels", "tools")
CONTROL_EVENTS = (
    "StageEntered",
    "FadeStarted",
    "FadeEnded",
    "ReferenceRefreshed",
    "OptimizerReset",
    "StackAppended",
    "ActivationsCached",
    "RunFinished",
)


def sources(rev: str | None) -> dict[str, str]:
    """{'engine/run/loop.py': text} for the five packages, from the tree or from `rev`."""
    if rev is None:
        return {
            str(p.relative_to(ROOT)): p.read_text()
            for pkg in PACKAGES
            for p in sorted((ROOT / pkg).rglob("*.py"))
        }
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, *PACKAGES],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        n: subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{n}"], capture_output=True, text=True, check=True
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def module_of(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "rewind." + ".".join(parts)


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules this module imports (at any depth: deferred imports count)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in known}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, each within one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v in seen or v not in graph:
            continue
        seen.add(v)
        todo.extend(graph[v])
    return seen


@functools.cache  # a test session reads the tree once
def figures(rev: str | None) -> dict:
    texts = sources(rev)
    trees = {path: ast.parse(text) for path, text in texts.items()}
    modules = {module_of(p): p for p in texts}
    graph = {module_of(p): imports(t, set(modules)) - {module_of(p)} for p, t in trees.items()}
    functions = sorted(
        (
            (node.end_lineno - node.lineno + 1, f"{path}:{node.name}")
            for path, tree in trees.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ),
        reverse=True,
    )
    naming = sorted(
        path
        for path, tree in trees.items()
        if any(
            isinstance(n, ast.Name | ast.alias) and getattr(n, "id", getattr(n, "name", "")) in CONTROL_EVENTS
            for n in ast.walk(tree)
        )
        or any(isinstance(n, ast.Attribute) and n.attr in CONTROL_EVENTS for n in ast.walk(tree))
    )
    return {
        "rev": rev or "working tree",
        "source_files": len(texts),
        "lines": sum(t.count("\n") for t in texts.values()),
        "modules_over_400_lines": sorted(
            (f"{p} {t.count(chr(10))}" for p, t in texts.items() if t.count("\n") > 400),
            key=lambda s: -int(s.split()[-1]),
        ),
        "longest_functions": [f"{name} {n}" for n, name in functions[:5]],
        "circles": [c for c in circles(graph) if len({m.split(".")[1] for m in c}) == 1],
        "files_naming_a_control_event": naming,
        "modules_a_resume_imports": len(reach(graph, "rewind.tools.train_cmd")),
    }


def circles_inside(package: str) -> list[list[str]]:
    """The import circles among the modules of `package` ('states', 'engine', ...) in the working tree."""
    return [c for c in figures(None)["circles"] if c[0].split(".")[1] == package]


def modules_over_400_lines(package: str) -> list[str]:
    return [m for m in figures(None)["modules_over_400_lines"] if m.split("/")[0] == package]


def private_imports(texts: dict[str, str], package: str) -> list[str]:
    """'path: module.name' for each private name a module of `package` imports from rewind (a name shared
    between modules has a home of its own, and is public there)."""
    found = []
    for path, text in texts.items():
        if path.split("/")[0] != package:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rewind."):
                found += [
                    f"{path}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    found = figures(args.rev)
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    for key, value in found.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
