"""The CPU budget of co-located processes (outrider.cpus)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from outrider.cpus import CpuListError, on_a_passing_thread, parse_cpus, plan_cpus


def test_cpu_lists_parse_and_bad_ones_name_the_flag():
    assert parse_cpus("0-2,5") == [0, 1, 2, 5]
    assert parse_cpus("3") == [3]
    for bad in ("", "a", "1-b", ","):
        with pytest.raises(CpuListError, match="--cpus"):
            parse_cpus(bad)


def test_the_target_gets_cores_of_its_own():
    assert plan_cpus([0]) is None  # one core: nothing to share out
    two = plan_cpus([0, 1])
    assert (two.target, two.router, two.small_step_threads) == ("0", "1", 1)
    sixteen = plan_cpus(list(range(16)))
    assert sixteen.target == ",".join(map(str, range(14))) and sixteen.router == "14,15"
    assert sixteen.small_step_threads == 14


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity only")
def test_a_role_runs_on_the_cores_it_was_given():
    core = sorted(os.sched_getaffinity(0))[0]
    code = ("import os; from outrider.cpus import pin_cpus; "
            f"pin_cpus('{core}'); print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"[{core}]"


def test_small_steps_run_on_the_small_step_threads_and_large_ones_on_all(llama_dir):
    """The target's plan: a forward of fewer than SMALL_STEP_TOKENS tokens, a decode
    step of any batch, or one with a draft working beside it, on its own cores' threads,
    any other on every thread it has."""
    import torch

    from outrider.engine.runner import SMALL_STEP_TOKENS, ForwardRequest, ModelRunner, RunnerConfig

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=1, small_step_threads=1))
        seen = []
        for tokens, beside in ((SMALL_STEP_TOKENS - 1, False), (SMALL_STEP_TOKENS, False),
                               (1, False), (SMALL_STEP_TOKENS, True)):
            runner.blocks.append(tokens, tokens)
            runner.forward([ForwardRequest([5] * tokens, 0, runner.blocks.block_table(tokens),
                                           1)], beside_draft=beside)
            seen.append(torch.get_num_threads())
            runner.blocks.free(tokens)
        assert seen == [1, 2, 1, 1]
        for kind, threads in (("by-kind", 1), ("by-size", 2)):
            runner.cfg = replace(runner.cfg, step_threads=kind)
            decode = [(seq, 1) for seq in range(SMALL_STEP_TOKENS + 4)]  # a token each
            for seq, n in decode:
                runner.blocks.append(seq, n)
            runner.forward([ForwardRequest([5], 0, runner.blocks.block_table(seq), 1)
                            for seq, _ in decode])
            assert torch.get_num_threads() == threads, kind
            for seq, _ in decode:
                runner.blocks.free(seq)
    finally:
        torch.set_num_threads(before)


def test_a_model_that_streams_its_weights_runs_every_step_on_every_thread(llama_dir,
                                                                          monkeypatch):
    """Past SMALL_STEP_WEIGHT_BYTES a rank, no forward is small: a decode step reads every
    weight, and from memory a second core's bandwidth pays (docs/DESIGN.md §10.1)."""
    import torch

    from outrider.engine import runner as runner_module
    from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=1, small_step_threads=1))
        for limit, threads in ((runner.weight_bytes, 1), (runner.weight_bytes - 1, 2)):
            monkeypatch.setattr(runner_module, "SMALL_STEP_WEIGHT_BYTES", limit)
            runner.blocks.append("s", 1)
            runner.forward([ForwardRequest([5], 0, runner.blocks.block_table("s"), 1)])
            assert torch.get_num_threads() == threads
            runner.blocks.free("s")
    finally:
        torch.set_num_threads(before)


def test_a_passing_thread_returns_what_start_returns_and_raises_what_it_raises():
    """A replica's start-up runs on a thread of its own that is gone once it returns (so
    the caller keeps no OpenMP pool of its forwards); results and errors come back."""
    threads = []

    @on_a_passing_thread
    def start(value: int) -> int:
        threads.append(threading.current_thread())
        if value < 0:
            raise ValueError("negative")
        return value * 2

    assert start(21) == 42
    assert threads[0] is not threading.current_thread() and not threads[0].is_alive()
    with pytest.raises(ValueError, match="negative"):
        start(-1)
