"""What the wheel ships, checked without building it (.ci/wheel-check builds and runs it).

The package list comes from setup.py (every folder holding files under the roots of
pyproject.toml's package-dir: Python files, or data files alone, as a data package); the
run-time data files come from [tool.setuptools.package-data].
A package or data file missing from the wheel only shows once installed outside the checkout
(outrider.telemetry once did: the installed outrider could not start), so these tests look
at what setuptools would build, read the way the build reads it.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import tomllib
import warnings
from pathlib import Path

import pytest

from outrider import paths

ROOT = Path(__file__).resolve().parents[1]
PYTHON_SUFFIXES = {".py", ".pyi", ".pyc"}
SKIP_DIRS = {"__pycache__", ".venv", ".git", "build", "dist", "node_modules"}
# Files in package folders that are deliberately not shipped: {relative path: why}.
NOT_SHIPPED: dict[str, str] = {}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_dir() -> dict[str, str]:
    return _pyproject()["tool"]["setuptools"]["package-dir"]


@pytest.fixture(scope="module")
def configured():
    """setuptools' Distribution as the build configures it (setup.py + pyproject.toml),
    stopped before any command runs: nothing is built or written; and the warnings the
    configuration raised."""
    from distutils.core import run_setup

    import setuptools  # noqa: F401  (first: distutils is then setuptools' own)

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return run_setup(str(ROOT / "setup.py"), stop_after="config"), caught
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def dist(configured):
    return configured[0]


def test_configuration_raises_no_setuptools_warning(configured):
    """Deprecated metadata (a `license` table once) warns at every build; the pin in
    [build-system] is the setuptools of the test extra, so this sees what the build sees."""
    import setuptools

    build_requires = _pyproject()["build-system"]["requires"]
    assert f"setuptools=={setuptools.__version__}" in build_requires
    noisy = [f"{w.category.__name__}: {str(w.message).strip().splitlines()[0]}"
             for w in configured[1] if "setuptools" in (w.filename + w.category.__module__)]
    assert not noisy, noisy


def _walk(base: Path):
    for directory, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        yield Path(directory), files


def _source_folders(marker=lambda files: any(f.endswith(".py") for f in files)) -> set[str]:
    """Installed names of the folders under each root whose files satisfy marker."""
    found = set()
    for name, folder in _package_dir().items():
        base = ROOT / folder
        for directory, files in _walk(base):
            parts = directory.relative_to(base).parts
            if marker(files) and all(p.isidentifier() for p in parts):
                found.add(".".join((name, *parts)))
    return found


def _folder_of(package: str) -> Path:
    """Source folder of an installed package name (longest package-dir prefix)."""
    mapping = _package_dir()
    key = max((k for k in mapping if package == k or package.startswith(k + ".")), key=len)
    return ROOT / mapping[key] / Path(*package[len(key):].split(".")[1:])


def test_no_hand_written_package_list():
    """A `packages` list in pyproject.toml would override setup.py's computed one."""
    assert "packages" not in _pyproject()["tool"]["setuptools"], \
        "pyproject.toml lists packages by hand; setup.py computes them"
    assert (ROOT / "setup.py").is_file()


def test_every_package_folder_is_shipped(dist):
    """Every folder with files is a package: its Python files are modules; a folder of data
    files alone is a data package (setuptools warns of one that is not listed), whose files
    the next test requires to be declared package data."""
    shipped = set(dist.packages)
    with_init = _source_folders(lambda files: "__init__.py" in files)
    with_code = _source_folders()
    with_files = _source_folders(lambda files: any(not f.startswith(".") for f in files))
    assert with_init <= shipped, f"packages not in the wheel: {sorted(with_init - shipped)}"
    assert with_code <= shipped, f"missing: {sorted(with_code - shipped)}"
    assert shipped == with_files, (f"missing: {sorted(with_files - shipped)}; "
                                   f"not folders with files: {sorted(shipped - with_files)}")
    assert {"outrider", "outrider.telemetry", "outrider.v1", "outrider.router",
            "outrider.target_worker", "outrider.draft_worker", "outrider.cluster",
            "outrider.bench.data"} <= shipped
    for package in shipped - with_code:  # data packages: each declares its files
        assert dist.package_data.get(package), f"{package}: no [tool.setuptools.package-data]"
    assert dist.package_dir == _package_dir()


def test_every_non_python_file_in_a_package_is_package_data(dist):
    """A data file next to the code is there to be read at run time: declare it (or list
    it in NOT_SHIPPED with the reason)."""
    shipped = set(dist.packages)
    undeclared = []
    for package in shipped:
        base = _folder_of(package)
        for directory, files in _walk(base):
            rel_dir = directory.relative_to(base)
            parts = rel_dir.parts
            if any(".".join((package, *parts[:k])) in shipped for k in range(1, len(parts) + 1)):
                continue  # inside another package's folder: checked as that package
            for name in files:
                rel = (rel_dir / name).as_posix()
                source = (directory / name).relative_to(ROOT).as_posix()
                if Path(name).suffix in PYTHON_SUFFIXES or name == "py.typed":
                    continue
                patterns = dist.package_data.get(package, []) + dist.package_data.get("", [])
                if source not in NOT_SHIPPED and not any(fnmatch.fnmatch(rel, p)
                                                         for p in patterns):
                    undeclared.append(source)
    assert not undeclared, f"not declared in [tool.setuptools.package-data]: {undeclared}"


FILE_READ = re.compile(r"__file__|importlib\.resources|resources\.files|pkgutil\.get_data")
FILE_NAME = re.compile(r"""["']([\w./-]+\.[A-Za-z0-9]+)["']""")


def _shipped_modules(dist):
    for package in dist.packages:
        folder = _folder_of(package)
        for path in sorted(folder.glob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield package, path


def test_files_the_code_reads_next_to_it_are_shipped(dist):
    """Path(__file__).parent / "x.html", importlib.resources ...: x must exist and be
    declared as package data of that module's package."""
    problems, seen = [], []
    for package, path in _shipped_modules(dist):
        for line in path.read_text().splitlines():
            if not FILE_READ.search(line):
                continue
            for name in FILE_NAME.findall(line):
                if Path(name).suffix in PYTHON_SUFFIXES:
                    continue
                seen.append(name)
                patterns = dist.package_data.get(package, [])
                if not (path.parent / name).is_file():
                    problems.append(f"{path.relative_to(ROOT)} reads {name}: no such file")
                elif not any(fnmatch.fnmatch(name, p) for p in patterns):
                    problems.append(f"{path.relative_to(ROOT)} reads {name}: not package data")
    assert not problems, problems
    assert "dashboard.html" in seen  # the scan itself still finds what it is for


def _imported_modules(path: Path, package: str | None):
    """(line, absolute name, is a module) for each import in the file; `from m import n`
    also yields m.n, which may be a submodule or an attribute."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, True
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                if package is None:
                    continue
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            yield node.lineno, module, True
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}", False


def _resolves(module: str, shipped: set[str]) -> bool | None:
    """True: a shipped package or a module of one; False: not in the wheel;
    None: no module or folder of that name (an attribute, for `from x import name`)."""
    if module in shipped:
        return True
    parent, _, leaf = module.rpartition(".")
    if parent not in shipped:
        return False
    folder = _folder_of(parent)
    if (folder / f"{leaf}.py").is_file():
        return True
    if (folder / leaf).is_dir():
        return False  # a folder the wheel does not ship as a package
    return None


def test_no_module_imports_a_package_the_wheel_lacks(dist):
    shipped = set(dist.packages)
    by_file: dict[Path, str | None] = {path: package for package, path in _shipped_modules(dist)}
    for extra in ("tests", "scripts"):
        for directory, files in _walk(ROOT / extra):
            by_file.update({directory / f: None for f in files if f.endswith(".py")})
    missing = set()
    for path, package in by_file.items():
        for lineno, module, is_module in _imported_modules(path, package):
            if module != "outrider" and not module.startswith("outrider."):
                continue
            if not is_module and module.rpartition(".")[0] not in shipped:
                continue  # `from outrider.x.module import name`: an attribute
            found = _resolves(module, shipped)
            if found is False or (is_module and found is None):
                missing.add(f"{path.relative_to(ROOT)}:{lineno}: {module}")
    assert not missing, f"imports of modules the wheel does not ship: {sorted(missing)}"


# --- finding the demo pair from an installed outrider (outrider/paths.py) ---

def test_demo_pair_found_in_the_checkout(monkeypatch):
    monkeypatch.delenv(paths.MODELS_ENV, raising=False)
    assert paths.is_checkout()
    target, draft = paths.demo_pair()
    assert target == ROOT / "models" / "demo-target" == paths.demo_target_dir()
    assert draft == ROOT / "models" / "demo-draft" == paths.demo_draft_dir()


def test_models_dir_from_the_environment(monkeypatch, tmp_path):
    for name in ("demo-target", "demo-draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.setenv(paths.MODELS_ENV, str(tmp_path))
    assert paths.demo_pair() == (tmp_path / "demo-target", tmp_path / "demo-draft")


def test_missing_pair_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.MODELS_ENV, str(tmp_path / "nowhere"))
    assert paths.demo_target_dir() == tmp_path / "nowhere" / "demo-target"  # no check: no error
    with pytest.raises(paths.DemoModelsNotFound) as err:
        paths.demo_pair()
    message = str(err.value)
    assert "\n" not in message
    assert str(tmp_path / "nowhere" / "demo-target") in message
    assert f"{paths.MODELS_ENV}={tmp_path / 'nowhere'}" in message
    assert "--target" in message and "--draft" in message
    assert isinstance(err.value, FileNotFoundError)


def test_missing_pair_in_an_installed_outrider(monkeypatch, tmp_path):
    """No checkout around the package (a wheel in site-packages) and no OUTRIDER_MODELS_DIR."""
    monkeypatch.delenv(paths.MODELS_ENV, raising=False)
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "site-packages")
    assert not paths.is_checkout()
    with pytest.raises(paths.DemoModelsNotFound) as err:
        paths.demo_draft_dir(must_exist=True)
    message = str(err.value)
    assert str(tmp_path / "site-packages" / "models" / "demo-draft") in message
    assert "no source checkout" in message and paths.MODELS_ENV in message
    assert "--target DIR" in message
