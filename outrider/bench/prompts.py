"""Where the benchmarks' prompts come from: held-out standard-library modules and prose
(the serving benchmark's workloads), and source files of third-party packages installed
beside Outrider (never in the repository, nor in the demo pair's training data), which
the benchmarks against vLLM write to a JSONL file its load client reads."""

from __future__ import annotations

import itertools
import json
import sysconfig
from pathlib import Path

from outrider import paths
from outrider.core.tokenizer import Tokenizer

WORKLOADS = ("code", "text")
PACKAGES = ("fastapi", "starlette", "pydantic", "jinja2", "yaml", "redis", "uvicorn",
            "opentelemetry", "prometheus_client", "tqdm", "safetensors", "tokenizers")


# -- the serving benchmark's workloads -----------------------------------------------------
def workload_prompts(tokenizer: Tokenizer, workload: str, num_prompts: int,
                     prompt_tokens: int) -> list[list[int]]:
    if workload == "code":
        return heldout_prompts(tokenizer, num_prompts, prompt_tokens)
    if workload == "text":
        return text_prompts(tokenizer, num_prompts)
    raise ValueError(f"unknown workload {workload!r}: use {', '.join(WORKLOADS)}")


def heldout_prompts(tokenizer: Tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` tokens of each held-out standard-library module."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = paths.heldout_modules_file().read_text().split()[:num_prompts]
    return [tokenizer.encode((stdlib / m).read_text())[:prompt_tokens] for m in modules]


def text_prompts(tokenizer: Tokenizer, num_prompts: int) -> list[list[int]]:
    """Prose prompts from outrider/bench/data/bench_text_prompts.txt (paragraphs; '#'
    lines are comments)."""
    lines = [line for line in text_prompts_file().read_text().splitlines()
             if not line.startswith("#")]
    paragraphs = [" ".join(p.split()) for p in "\n".join(lines).split("\n\n") if p.strip()]
    return [tokenizer.encode(p) for p in paragraphs[:num_prompts]]


def text_prompts_file() -> Path:
    return paths.BENCH_DATA / "bench_text_prompts.txt"


# -- installed packages' sources -----------------------------------------------------------
def package_sources(packages=PACKAGES, min_chars: int = 1500) -> list[Path]:
    """Source files of installed third-party packages, in a stable order."""
    import importlib.util

    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            files += [f for f in sorted(Path(folder).rglob("*.py"))
                      if f.stat().st_size >= min_chars]
    return files


def package_prompts(tokenizer, num_prompts: int, prompt_tokens: int) -> list[str]:
    """The first `prompt_tokens` tokens of each of `num_prompts` files (round robin over
    the packages, so every package is represented), as text; when there are fewer files,
    they are used again from the first (and then hit prefix caches)."""
    by_package: dict[str, list[Path]] = {}
    for f in package_sources():
        by_package.setdefault(_package_of(f), []).append(f)
    ordered = [f for group in itertools.zip_longest(*by_package.values()) for f in group if f]
    if not ordered:
        raise RuntimeError("found no package source files for prompts")
    prompts = []
    for f in ordered[:num_prompts]:
        ids = tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")[:8 * prompt_tokens])
        prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def _package_of(path: Path) -> str:
    for name in PACKAGES:
        if name in path.parts:
            return name
    return path.parts[-2]


def write_prompts(prompts: list[str], folder: Path, name: str = "prompts") -> Path:
    """The prompts as `vllm bench serve --dataset-name custom` reads them (NAME.jsonl)."""
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path
