"""Reading the Dockerfile, .dockerignore and pyproject.toml (no Docker engine here)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tests.deploy.objects import ROOT

DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, rest)

    def all(self, keyword: str) -> list[str]:
        return [rest for k, rest in self.instructions if k == keyword]


def stages() -> list[Stage]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            found.append(Stage(m.group(2)))
        if found:
            found[-1].instructions.append((keyword, rest.strip()))
    return found


def build_args() -> dict[str, str]:
    """ARG defaults of the final stage (and the global ones before the first FROM)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of the stage's COPY lines taken from the build context."""
    result = []
    for rest in stage.all("COPY"):
        if rest.startswith("--from"):
            continue
        *sources, dest = rest.split()
        result.append((sources, dest))
    return result


def image_path_source(path: str) -> Path | None:
    """The repository folder that the image's `path` is copied from, or None."""
    for sources, dest in copies(stages()[-1]):
        for source in sources:
            if dest.endswith("/") and source.endswith("/"):
                target = PurePosixPath(dest)
                if PurePosixPath(path).is_relative_to(target):
                    candidate = ROOT / source / PurePosixPath(path).relative_to(target)
                    return candidate if candidate.exists() else None
    return None


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pin(name: str) -> str | None:
    """The version pyproject pins `name` at, in the base dependencies or an extra."""
    project = pyproject()["project"]
    extras = project.get("optional-dependencies", {}).values()
    for dep in [*project["dependencies"], *(d for deps in extras for d in deps)]:
        m = re.fullmatch(rf"{re.escape(name)}(\[[\w,]+\])?==(\S+)", dep.replace(" ", ""))
        if m:
            return m.group(2)
    return None


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not checked here"
    return patterns


def is_ignored(relative: str) -> bool:
    parts = PurePosixPath(relative).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in dockerignore():
        tail = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1],
                                                                   tail):
                return True
    return False
