"""Import cycles between the modules of tvm_llm (and schedules), read from the source with `ast`.

    python scripts/import_cycles.py          # prints each cycle; exit code 1 if there is one

Every import counts, also those inside functions (a lazy import still ties the two modules
together) and a package's `__init__` importing its submodules; `from pkg import submodule`
counts as importing the submodule only. Also checks the one-way rule
of docs/ARCHITECTURE.md that is cheap to state: the runtime and the server import nothing of
the compiler, and memory/ imports neither the frontend nor the passes.
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tvm_llm", "schedules")
# (modules under this prefix, may not import modules under these prefixes)
FORBIDDEN = (("tvm_llm.runtime", ("tvm_llm.frontend", "tvm_llm.passes", "tvm_llm.build",
                                  "tvm_llm.front", "tvm_llm.config", "tvm_llm.targets",
                                  "tvm_llm.quantization", "tvm_llm.tune", "schedules")),
             ("tvm_llm.serve", ("tvm_llm.frontend", "tvm_llm.passes", "tvm_llm.build",
                                "tvm_llm.front", "tvm_llm.config", "tvm_llm.targets",
                                "tvm_llm.tune", "schedules")),
             ("tvm_llm.memory", ("tvm_llm.frontend", "tvm_llm.passes", "tvm_llm.build",
                                 "tvm_llm.front")))


def modules(root: str = ROOT) -> dict:
    """module name -> file path."""
    out = {}
    for package in PACKAGES:
        for d, _, files in os.walk(os.path.join(root, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def import_graph(root: str = ROOT) -> dict:
    """module -> set of the modules of ours it imports."""
    mods = modules(root)
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        base = m.split(".") if path.endswith("__init__.py") else m.split(".")[:-1]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = base[:len(base) - node.level + 1] if node.level else []
                target = ".".join(parts + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names]
                # `from pkg import submodule` imports the submodule, not pkg's own names
                names = subs if all(n in mods for n in subs) else [target] + subs
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def forbidden(graph: dict) -> list:
    """(module, imported module) pairs breaking the FORBIDDEN rules."""
    bad = []
    for m, deps in graph.items():
        for prefix, banned in FORBIDDEN:
            if m == prefix or m.startswith(prefix + "."):
                bad += [(m, d) for d in sorted(deps)
                        if any(d == b or d.startswith(b + ".") for b in banned)]
    return bad


def main() -> int:
    graph = import_graph()
    found, bad = cycles(graph), forbidden(graph)
    for comp in found:
        print("cycle: " + " <-> ".join(comp))
    for m, d in bad:
        print(f"forbidden: {m} imports {d}")
    print(f"{len(graph)} modules, {len(found)} cycles, {len(bad)} forbidden imports")
    return 1 if found or bad else 0


if __name__ == "__main__":
    sys.exit(main())
