"""Starting a tensor-parallel group: rank 0 in this process, ranks 1.. as child processes.

Ranks meet over a TCP rendezvous on a free loopback port (or an address from config)
and form two process groups: one for tensors (NCCL on CUDA, gloo on CPU) and a gloo one
for the driver's forward descriptions.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from outrider.cpus import available_cpus, format_cpus, pin_cpus
from outrider.engine.model_config import ModelConfig
from outrider.engine.parallel import TPGroup
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.launch import free_port


def init_tp_group(rank: int, size: int, init_method: str, device: str) -> TPGroup:
    if size == 1:
        return TPGroup()
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if is_cuda else "gloo", init_method=init_method,
                            rank=rank, world_size=size, timeout=timedelta(seconds=120))
    cpu_group = dist.new_group(backend="gloo") if is_cuda else dist.group.WORLD
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD, cpu_group=cpu_group)


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank % torch.cuda.device_count()}" if device.startswith("cuda") else device


def set_cpu_threads(cfg: RunnerConfig, rank: int = 0) -> None:
    """This rank's share of the cores the process may use: on a CPU device with enough
    of them each rank runs on its own (ranks of one group must not preempt each other
    mid-collective), and with as many torch threads as it has cores."""
    cores = available_cpus()
    share = max(1, len(cores) // cfg.tp)
    mine = cores[rank * share:(rank + 1) * share] if len(cores) >= cfg.tp else cores
    if cfg.device == "cpu" and cfg.tp > 1 and len(cores) >= cfg.tp:
        pin_cpus(format_cpus(mine))
    torch.set_num_threads(cfg.threads or len(mine))


def run_tp_rank(cfg: RunnerConfig, rank: int, init_method: str) -> None:
    """A non-driver rank: join the group, load its shard, follow the driver's forwards
    until it says stop."""
    set_cpu_threads(cfg, rank)
    tp = init_tp_group(rank, cfg.tp, init_method, cfg.device)
    runner = ModelRunner(replace(cfg, device=rank_device(cfg.device, rank)), tp)
    try:
        runner.serve_driver()
    finally:
        dist.destroy_process_group()


class TPRunnerGroup:
    """The driver's ModelRunner plus the worker processes holding the other shards."""

    def __init__(self, cfg: RunnerConfig, init_method: str | None = None,
                 spawn_ranks: bool = True) -> None:
        ModelConfig.from_dir(cfg.model_dir).check_tp(cfg.tp)  # fail before spawning ranks
        self.processes: list[mp.Process] = []
        self.size = cfg.tp
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        if cfg.tp > 1 and spawn_ranks:
            ctx = mp.get_context("spawn")
            for rank in range(1, cfg.tp):
                proc = ctx.Process(target=run_tp_rank, args=(cfg, rank, init_method),
                                   daemon=True)
                proc.start()
                self.processes.append(proc)
        set_cpu_threads(cfg)
        try:
            tp = init_tp_group(0, cfg.tp, init_method, cfg.device)
            self.runner = ModelRunner(replace(cfg, device=rank_device(cfg.device, 0)), tp)
        except BaseException:
            self._kill()
            raise

    def close(self) -> None:
        if self.size > 1:
            self.runner.stop_workers()
            for proc in self.processes:
                proc.join(timeout=30)
            self._kill()
            dist.destroy_process_group()

    def _kill(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        self.processes = []
