"""The import rule of docs/DESIGN.md §1: roles never import one another; shared packages
import no role and no composer; only composers put roles together. Checked on the source
(every import statement, at any depth), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

from setup import package_dir

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("outrider.router", "outrider.target_worker", "outrider.draft_worker")
# What puts roles together: the command line, `outrider serve`, the benchmarks and the
# Ray deployment (its actors host the roles, its spec builds their configurations).
COMPOSERS = ("outrider.cli", "outrider.local_system", "outrider.bench", "outrider.cluster")


def owner(module: str, owners: tuple[str, ...]) -> str | None:
    return next((o for o in owners if module == o or module.startswith(o + ".")), None)


def modules() -> dict[str, Path]:
    """Every source module of the distribution, by installed name."""
    found = {}
    for name, folder in package_dir(ROOT).items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found.setdefault(".".join((name, *parts)), path)
    return found


def imported(path: Path) -> set[str]:
    """Every outrider module a file names in an import (absolute, at any depth)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("outrider.")}


def violations(module: str, targets: set[str]) -> list[str]:
    source_role = owner(module, ROLES)
    if owner(module, COMPOSERS):
        return []
    wrong = []
    for target in sorted(targets):
        target_role, target_composer = owner(target, ROLES), owner(target, COMPOSERS)
        if source_role and target_role and target_role != source_role:
            wrong.append(f"{module} (role) imports {target} (another role)")
        elif not source_role and (target_role or target_composer):
            kind = "a role" if target_role else "a composer"
            wrong.append(f"{module} (shared) imports {target} ({kind})")
        elif source_role and target_composer:
            wrong.append(f"{module} (role) imports {target} (a composer)")
    return wrong


def test_the_scan_sees_the_whole_distribution():
    found = modules()
    for role in (*ROLES, *COMPOSERS):
        assert any(owner(m, (role,)) for m in found), role
    assert "outrider.state.redis_store" in found and "outrider.core.tokenizer" in found


def test_the_rule_catches_a_crossing():
    assert violations("outrider.draft_worker.main", {"outrider.router.service"})
    assert violations("outrider.engine.local", {"outrider.cluster.spec"})
    assert violations("outrider.router.main", {"outrider.cli"})
    assert not violations("outrider.router.main", {"outrider.router.service",
                                                   "outrider.state", "outrider.core"})
    assert not violations("outrider.cluster.actors", {"outrider.router.main"})


def test_no_module_crosses_a_layer():
    found = modules()
    assert [v for m, path in found.items() for v in violations(m, imported(path))] == []
