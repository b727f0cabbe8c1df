"""The import rule of docs/ARCHITECTURE.md, read from the source (scripts/import_cycles.py):
no cycle between modules, and the runtime, the server and the memory planner stay below the
compiler."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checker():
    spec = importlib.util.spec_from_file_location(
        "import_cycles", os.path.join(REPO, "scripts", "import_cycles.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_and_no_forbidden_import():
    checker = _checker()
    graph = checker.import_graph(REPO)
    assert "tvm_llm.front" in graph and "tvm_llm.config" in graph["tvm_llm.front"]
    assert checker.cycles(graph) == []
    assert checker.forbidden(graph) == []


def test_the_checker_finds_a_cycle_and_a_forbidden_import():
    checker = _checker()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"},
             "tvm_llm.runtime.engine": {"tvm_llm.passes.pipeline"}, "tvm_llm.passes.pipeline": set()}
    assert checker.cycles(graph) == [["a", "b", "c"]]
    assert checker.forbidden(graph) == [("tvm_llm.runtime.engine", "tvm_llm.passes.pipeline")]
