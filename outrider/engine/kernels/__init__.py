"""C++ kernels for the CPU, built with torch's extension tooling on first use and cached.

The build is keyed by the source, torch's version and this CPU's instruction set (the
code is compiled for the machine it runs on), so a cache shared between machines never
loads code a CPU cannot run. Where no compiler is present, or the build fails, one log
line says so and callers keep their pure-torch path: the package installs and runs
without a compiler.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp",
                                                          "elementwise.cpp", "int4_gemm.cpp",
                                                          "int8_gemm.cpp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("vec.h", "amx.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_ENV = "OUTRIDER_NO_CPU_KERNELS"  # set to 1: the pure-torch path, no build


def build_dir() -> Path:
    """$OUTRIDER_KERNEL_CACHE, else ~/.cache/outrider/kernels."""
    default = Path.home() / ".cache" / "outrider" / "kernels"
    return Path(os.environ.get("OUTRIDER_KERNEL_CACHE", default))


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    # the sources' folder too: the build's ninja file names them, and two checkouts
    # sharing one cache would otherwise rebuild each other's kernels in turn
    digest.update(str(SOURCES[0].parent.resolve()).encode())
    digest.update(" ".join([torch.__version__, platform.machine(), *FLAGS,
                            cpu_flags()]).encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (else its processor's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_enabled = [os.environ.get(DISABLE_ENV) != "1"]


def use_cpu_kernels(enabled: bool) -> None:
    """Turn the kernels on or off for this process (benchmarks measure both paths)."""
    _enabled[0] = enabled


def cpu_kernels_loaded() -> bool:
    """Whether CPU forwards run the C++ kernels: enabled, built (or reused) and loaded."""
    return _enabled[0] and _load()


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether a forward over `x` takes the C++ kernels: on CPU, eager (a compiled forward
    leaves its elementwise steps to the compiler, which fuses them itself) and without
    gradients (they have none: a draft that learns trains through the torch ops)."""
    return (x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and cpu_kernels_loaded())


@functools.cache
def _load() -> bool:
    """Build (or reuse) and load the kernels once; False, logged once, when they cannot be."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return _unavailable(f"no C++ compiler ({compiler!r} not found)")
    from torch.utils import cpp_extension

    name = f"outrider_cpu_{_build_key()}"
    directory = build_dir() / name
    quiet = logging.getLogger(cpp_extension.__name__)  # its compiler-version notices
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _building(directory):
            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                               extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                               build_directory=str(directory), is_python_module=False,
                               verbose=False)
    except Exception as exc:  # no ninja, a failed build, an unwritable cache
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return _unavailable(f"{type(exc).__name__}: {first_line[:200]}")
    finally:
        quiet.setLevel(level)
    return True


@contextlib.contextmanager
def _building(directory: Path):
    """One process at a time builds or loads in `directory`, under a lock the kernel
    frees when its holder dies. torch's own lock file is left behind by a build that was
    killed (a replica stopped mid-start), and makes every later load wait for it forever:
    whoever holds ours finds any such file stale and removes it."""
    with open(directory / ".outrider-build", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)  # torch's FileBaton
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unavailable(why: str) -> bool:
    log.warning("CPU kernels (paged attention, fused elementwise steps) unavailable (%s); "
                "using the pure-torch path", why)
    return False

