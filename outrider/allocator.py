"""The router process runs on jemalloc when the system has it (docs/RELIABILITY.md "Load
and soak"). Its ~90 gRPC and HTTP threads fragment glibc's per-thread heaps: under a
64-stream soak its resident memory crept ~1 MB a minute with a flat Python heap, and
`malloc_trim` only slowed it; on jemalloc it stays flat. The target and the draft grew
more on jemalloc than on glibc, so they keep glibc.

An allocator is chosen before the process starts (LD_PRELOAD), so `outrider router`
starts itself again, once, with jemalloc preloaded. OUTRIDER_ALLOCATOR=system keeps
glibc's.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

ENV = "OUTRIDER_ALLOCATOR"
# the purge thread returns freed pages to the system within jemalloc's decay time
MALLOC_CONF = "background_thread:true"


def run_on_jemalloc() -> None:
    """Replace this process with itself on jemalloc, unless it already is, it is asked
    not to be, or the system has no jemalloc (then it goes on, on glibc)."""
    if os.environ.get(ENV) in ("system", "jemalloc"):  # "jemalloc": started again already
        return
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        return
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD", "")]))
    env = dict(os.environ, LD_PRELOAD=preload, MALLOC_CONF=MALLOC_CONF, **{ENV: "jemalloc"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
