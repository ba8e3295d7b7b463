"""The router process runs on jemalloc when the system has one (outrider/allocator.py),
still as one process (it replaced itself: a supervisor's pid stays its pid), and on glibc
when OUTRIDER_ALLOCATOR=system."""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import pytest

from outrider import paths
from outrider.launch import outrider_process

HAS_JEMALLOC = ctypes.util.find_library("jemalloc") is not None


def loads_jemalloc(pid: int) -> bool:
    return "jemalloc" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("allocator", [None, "system"])
def test_the_router_runs_on_jemalloc_unless_told_not_to(allocator):
    env = {"OUTRIDER_ALLOCATOR": allocator} if allocator else {}
    args = ("router", "--model", str(paths.demo_target_dir()), "--port", "0",
            "--http-port", "0", "--target-address", "127.0.0.1:1")
    with outrider_process(*args, env=env) as (proc, address):
        assert address  # it listens: the pid started is the router itself
        assert loads_jemalloc(proc.pid) == (HAS_JEMALLOC and allocator is None)
