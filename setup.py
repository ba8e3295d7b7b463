"""The package list, computed, so that no package can be left out of the wheel.

pyproject.toml holds the metadata, the layout ([tool.setuptools] package-dir: outrider/ and
the top-level router/, target_worker/, draft_worker/ and cluster/, installed as
outrider.router etc.) and the package data. This file only lists the packages: every folder
under a package-dir root that holds files, by its installed name: Python files (an
__init__.py, or modules of a namespace package), or data files alone (outrider/bench/data),
which setuptools wants listed as a package of their own, their files declared in
[tool.setuptools.package-data] (without it the build warns that the folder is "absent from
the `packages` configuration"). tests/test_packaging.py checks the result.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent


def package_dir(root: Path = HERE) -> dict[str, str]:
    """Installed package name -> source folder (relative to root), from pyproject.toml."""
    with open(root / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def holds_files(directory: Path) -> bool:
    """A folder that ships something: a file in it, hidden files aside."""
    return any(p.is_file() and not p.name.startswith(".") for p in directory.iterdir())


def find_packages(root: Path = HERE) -> list[str]:
    """Every folder holding files (Python or data) under each package-dir root, by
    installed name."""
    found: set[str] = set()
    for name, folder in package_dir(root).items():
        base = root / folder
        for directory in [base, *sorted(p for p in base.rglob("*") if p.is_dir())]:
            parts = directory.relative_to(base).parts
            if any(part == "__pycache__" or not part.isidentifier() for part in parts):
                continue
            if holds_files(directory):
                found.add(".".join((name, *parts)))
    return sorted(found)


if __name__ == "__main__":
    from setuptools import setup

    setup(packages=find_packages())
