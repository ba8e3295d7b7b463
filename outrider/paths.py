"""Where the shipped demo model pair lives (override with OUTRIDER_MODELS_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def models_dir() -> Path:
    return Path(os.environ.get("OUTRIDER_MODELS_DIR", REPO_ROOT / "models"))


def demo_target_dir() -> Path:
    return models_dir() / "demo-target"


def demo_draft_dir() -> Path:
    return models_dir() / "demo-draft"


def heldout_modules_file() -> Path:
    return REPO_ROOT / "data" / "heldout_modules.txt"
