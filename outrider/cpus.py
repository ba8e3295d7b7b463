"""CPU cores for processes that share a machine. `outrider serve` on a CPU keeps the last
cores for the router (with whatever clients run there) and gives the target replica the
others to itself for its small steps (and its decode steps, which keep the router busy
streaming a delta per token), every core for its large ones: a model's threads
that meet other busy processes on their cores wait at every parallel region for the one
that was preempted, and the target's forward is the step every request waits on; but a
large step (a verification or a prefill) has work for every core, and the router then
needs a small share of one. A draft replica drafts on
the target's cores while the target waits for its Propose (they are idle then) and on the
others while the target verifies (overlap): draft-worker --target-cpus. Every role takes
`--cpus LIST`."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")
ROUTER_SHARE = 8  # one core in this many is kept off the target (at least one)


class CpuListError(ValueError):
    """A --cpus value that names no usable core; the message says why."""


def parse_cpus(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    cores: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise CpuListError(f"--cpus {text!r}: expected a list like 0-2,5") from None
    if not cores:
        raise CpuListError(f"--cpus {text!r}: names no core")
    return sorted(cores)


def format_cpus(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def available_cpus() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))


def pin_cpus(text: str) -> None:
    """Run this process (and the threads it starts from now on) on the cores `text` names."""
    cores = parse_cpus(text)
    allowed = set(available_cpus())
    if not set(cores) <= allowed:
        raise CpuListError(f"--cpus {text!r}: this process may only use cores "
                           f"{format_cpus(sorted(allowed))}")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


@dataclass(frozen=True)
class CpuPlan:
    """Cores per role, as --cpus values: `target` are the target's own cores (its small
    steps run one thread on each; its large ones on every core), `router` the rest."""

    target: str
    router: str

    @property
    def small_step_threads(self) -> int:
        return len(parse_cpus(self.target))


def plan_cpus(cores: list[int] | None = None) -> CpuPlan | None:
    """The target replica on all cores but the last few, the router on those (None
    with a single core: there is nothing to share out)."""
    cores = sorted(cores or available_cpus())
    if len(cores) < 2:
        return None
    spare = cores[-max(1, len(cores) // ROUTER_SHARE):]
    return CpuPlan(target=format_cpus(cores[:-len(spare)]), router=format_cpus(spare))


def on_a_passing_thread(start: Callable[P, T]) -> Callable[P, T]:
    """`start` run on a thread that ends when it returns (its result returned, its
    exception raised on the caller's). For a replica's start-up, whose forwards (loading,
    warm-up, the cost runs) would otherwise leave the calling thread an OpenMP pool for
    good: libgomp keeps a pool of workers for each thread that ran a parallel region, as
    long as that thread lives, and once a process's pools hold more threads than it has
    cores it stops spinning between regions. The engine thread's workers then slept and
    were woken at every parallel region of every step: a 140M-parameter W4A16 decode step
    served at one stream took ~76 context switches and 14.7 ms, against 6.6 ms for the
    forward alone (docs/DESIGN.md §8.4)."""

    @functools.wraps(start)
    def started(*args: P.args, **kwargs: P.kwargs) -> T:
        outcome: list = []

        def run() -> None:
            try:
                outcome.append((True, start(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                outcome.append((False, exc))

        # daemon: a Ctrl-C that interrupts the join ends the process, not the start-up
        thread = threading.Thread(target=run, name=f"{start.__module__}.{start.__name__}",
                                  daemon=True)
        thread.start()
        thread.join()
        succeeded, value = outcome[0]
        if not succeeded:
            raise value
        return value

    return started
