"""Reading Hugging Face safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """Checkpoint files are missing, corrupt or do not match the model."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) listed in {INDEX_FILE} are missing: "
                                  f"{', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


def iter_tensor_slices(model_dir: Path) -> Iterator[tuple[str, object]]:
    """Yield (name, lazy slice) for every tensor; a slice reads only what is indexed.
    A progress bar shows on a terminal (not in logs)."""
    files = checkpoint_files(model_dir)
    with tqdm(total=sum(_num_tensors(p) for p in files), desc=f"loading {model_dir.name}",
              unit="tensor", disable=None, leave=False) as bar:
        for path in files:
            with _opened(path) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_slice(name)
                    bar.update()


def tensor_names(model_dir: Path) -> set[str]:
    """The names of every tensor of the checkpoint (nothing read)."""
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with _opened(path) as f:
            names.update(f.keys())
    return names


def _num_tensors(path: Path) -> int:
    with _opened(path) as f:
        return len(f.keys())


@contextmanager
def _opened(path: Path):
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc
