"""Start-up time and resident memory of `outrider router` (no replica behind it), for
one or more source trees side by side, e.g. before and after a change:

    git worktree add /tmp/before <commit>
    .venv/bin/python scripts/router_footprint.py /tmp/before .

Each tree runs from its own files (the package is assembled from its folders, as the
wheel installs them), in turns, `--runs` times. Prints seconds to "listening on" and
VmRSS one second later."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLES = ("router", "target_worker", "draft_worker", "cluster")


def assemble(tree: Path, into: Path) -> Path:
    """`tree`'s sources as the installed layout: outrider/ plus outrider/<role>."""
    package = into / "outrider"
    package.mkdir(parents=True)
    for item in (tree / "outrider").iterdir():
        (package / item.name).symlink_to(item.resolve())
    for role in ROLES:
        (package / role).symlink_to((tree / role).resolve())
    return into


def footprint(root: Path, model: str, port: int) -> tuple[float, float]:
    code = (f"import sys\nsys.meta_path = [f for f in sys.meta_path "
            f"if 'editable' not in repr(f).lower()]\nsys.path.insert(0, {str(root)!r})\n"
            f"from outrider.cli import main\n"
            f"main(['router', '--model', {model!r}, '--port', '{port}', '--no-http'])\n")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir())
    try:
        for line in proc.stdout:
            if "listening on" in line:
                break
        ready = time.perf_counter() - start
        time.sleep(1.0)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        return ready, int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--model", default=str(Path(__file__).parents[1] / "models" /
                                               "demo-target"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from outrider.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        roots = [assemble(t, Path(tmp) / str(i)) for i, t in enumerate(args.trees)]
        for _ in range(args.runs):
            for tree, root in zip(args.trees, roots):
                ready, rss = footprint(root, args.model, free_port())
                print(f"{tree}: listening after {ready:.2f} s, RSS {rss:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
