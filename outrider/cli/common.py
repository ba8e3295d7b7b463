"""What several subcommands share: the model flags and their resolution, usage errors,
and waiting for a stop signal."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from outrider import paths
from outrider.flags import add_compile_arg


class UsageError(ValueError):
    pass


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target checkpoint dir (default: the shipped demo target)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the demo draft when the "
                                   "target is the demo target, else none)")
    p.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per round (0: no speculation; default 4)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the target")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV budget per rank")
    add_compile_arg(p)


def model_dirs(args) -> tuple[Path, str | None]:
    """(target, draft): the shipped demo pair unless told otherwise. Fills in the default
    --gamma, which `generate` leaves unset so that it can tell a remote router "auto"."""
    target = Path(args.target) if args.target else paths.demo_target_dir(must_exist=True)
    draft = args.draft
    if draft is None and target.resolve() == paths.demo_target_dir().resolve():
        draft = str(paths.demo_draft_dir(must_exist=True))
    if not (target / "config.json").is_file():
        raise UsageError(f"no model at {target} (pass --target DIR)")
    if args.gamma is None:
        from outrider.target_worker.main import TargetWorkerConfig

        args.gamma = TargetWorkerConfig.gamma
    if args.gamma < 0:
        raise UsageError(f"--gamma must be >= 0, got {args.gamma}")
    return target, draft


def stop_on_signals() -> threading.Event:
    """An event SIGTERM or Ctrl-C sets: a foreground command waits on it and then shuts
    down in order (SIGTERM would otherwise end the process without any cleanup)."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping
