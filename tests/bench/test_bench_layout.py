"""outrider/bench is a tree: the shared modules below, each benchmark a leaf, and the report
on top reading results files through the shared tables. Read from the sources (every
import, those inside functions too), so nothing is imported here."""

from __future__ import annotations

import ast
from pathlib import Path

from outrider import paths

BENCH = paths.REPO_ROOT / "outrider" / "bench"
# the modules the benchmarks share; any other module but the report is a benchmark
SHARED = {"common", "prompts", "servers", "tables", "plots", "hf_peer"}
REPORT = "report"


def bench_imports(path: Path, names: set[str]) -> set[str]:
    """The outrider.bench modules (of `names`) that the file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "outrider.bench" if node.level else (node.module or "")
            if node.level and node.module:
                base += f".{node.module}"
            modules = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[:2] == ["outrider", "bench"] and len(parts) > 2 and parts[2] in names:
                found.add(parts[2])
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in BENCH.glob("*.py") if p.stem != "__init__"}
    return {name: bench_imports(path, set(files)) for name, path in files.items()}


def test_the_shared_modules_and_the_report_exist():
    assert SHARED | {REPORT} <= set(graph())


def test_no_benchmark_imports_another_or_the_report():
    runners = set(graph()) - SHARED - {REPORT}
    wrong = {name: sorted(imported - SHARED) for name, imported in graph().items()
             if name in runners and imported - SHARED}
    assert not wrong, f"benchmarks importing more than the shared modules: {wrong}"


def test_the_report_and_the_shared_modules_import_only_shared_modules():
    wrong = {name: sorted(imported - SHARED) for name, imported in graph().items()
             if name in SHARED | {REPORT} and imported - SHARED}
    assert not wrong, f"importing a benchmark or the report: {wrong}"


def test_the_shared_modules_import_each_other_without_a_cycle():
    edges = {name: graph()[name] & SHARED for name in SHARED}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for other in sorted(edges[name]):
                visit(other, (*path, name))
            done.add(name)

    for name in sorted(SHARED):
        visit(name, ())


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("from outrider.bench import common\n\ndef f():\n"
                      "    from outrider.bench.versus import table\n"
                      "    from . import prefix\n    import outrider.bench.step\n")
    assert bench_imports(module, {"common", "versus", "prefix", "step", "adapt"}) == {
        "common", "versus", "prefix", "step"}
