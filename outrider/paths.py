"""Where the shipped demo model pair lives (override with OUTRIDER_MODELS_DIR).

In a source checkout the pair is the checkout's models/demo-target and models/demo-draft.
An installed outrider (a wheel, no checkout) ships no models: it finds them through
OUTRIDER_MODELS_DIR (the image sets /app/models) or is given --target/--draft.

demo_target_dir() and demo_draft_dir() only compute the path (argument parsers use them as
defaults, so they must not fail); pass must_exist=True, or call demo_pair(), to get a
DemoModelsNotFound that says where the pair was looked for and how to point at it.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DATA = Path(__file__).resolve().parent / "bench" / "data"  # shipped in the wheel
MODELS_ENV = "OUTRIDER_MODELS_DIR"
DEMO_TARGET = "demo-target"
DEMO_DRAFT = "demo-draft"
DEMO_HEAD = "demo-eagle3"  # an EAGLE-3 head for the demo target (engine/heads.py)
# the demo target in 4-bit weights (W4A16, groups of 32: scripts/quantize_checkpoint.py)
DEMO_TARGET_W4A16 = "demo-target-w4a16"
# a draft with its own tokenizer (a 2,048-token BPE), distilled from the demo target's text
# (scripts/train_cross_draft.py; engine/cross_vocab.py)
DEMO_CROSS_DRAFT = "demo-draft-bpe2k"


class DemoModelsNotFound(FileNotFoundError):
    """The demo pair is not where it was looked for (the message is one line)."""


def is_checkout() -> bool:
    """True when this outrider runs from its source tree, not an installed wheel."""
    return (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "outrider").is_dir()


def models_dir() -> Path:
    """$OUTRIDER_MODELS_DIR when set (and not empty), else the checkout's models/."""
    return Path(os.environ.get(MODELS_ENV) or REPO_ROOT / "models")


def demo_target_dir(*, must_exist: bool = False) -> Path:
    return _demo_dir(DEMO_TARGET, must_exist)


def demo_draft_dir(*, must_exist: bool = False) -> Path:
    return _demo_dir(DEMO_DRAFT, must_exist)


def demo_head_dir(*, must_exist: bool = False) -> Path:
    return _demo_dir(DEMO_HEAD, must_exist)


def demo_w4a16_target_dir(*, must_exist: bool = False) -> Path:
    return _demo_dir(DEMO_TARGET_W4A16, must_exist)


def demo_cross_draft_dir(*, must_exist: bool = False) -> Path:
    return _demo_dir(DEMO_CROSS_DRAFT, must_exist)


def demo_pair() -> tuple[Path, Path]:
    """(target, draft) of the demo pair; DemoModelsNotFound when either is missing."""
    return demo_target_dir(must_exist=True), demo_draft_dir(must_exist=True)


def heldout_modules_file() -> Path:
    return BENCH_DATA / "heldout_modules.txt"


def _demo_dir(name: str, must_exist: bool) -> Path:
    path = models_dir() / name
    if must_exist and not (path / "config.json").is_file():
        raise DemoModelsNotFound(not_found_message(path))
    return path


def not_found_message(path: Path) -> str:
    """One line: where the model was looked for, why there, and how to point elsewhere."""
    env = os.environ.get(MODELS_ENV)
    if env:
        where = f"{MODELS_ENV}={env}"
    elif is_checkout():
        where = f"the checkout's models/ folder; {MODELS_ENV} is not set"
    else:
        where = (f"{MODELS_ENV} is not set and this installed outrider has no source checkout "
                 "(the wheel ships no models)")
    return (f"no demo model at {path} ({where}): pass --target DIR (and --draft DIR), or set "
            f"{MODELS_ENV} to a folder holding {DEMO_TARGET}/ and {DEMO_DRAFT}/ "
            "(a checkout's models/ folder)")
