"""How much KV cache a rank allocates when --kv-cache-mb is not given.

On a GPU, as vLLM's --gpu-memory-utilization, a limit per process: the process may take
that share of the device (default 0.9), weights and activations included, whatever other
processes hold; the KV cache gets what the share leaves after this process's own memory
(its weights) and the room a large forward needs, and never more than is free now less
that room. Processes sharing one GPU (a draft beside its target, `outrider serve`) each
take their own share: the shares must add up to at most 1. On a CPU every replica of a
machine shares its RAM (the target, the draft replicas, tensor-parallel ranks), so the
flag is the share of the machine's memory (its cgroup limit in a container) one rank's KV
cache may take (default 0.1), never more than is available now less a margin, nor more
than a full batch of full-length sequences can use."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

GPU_SHARE = 0.9  # vLLM's default --gpu-memory-utilization
CPU_SHARE = 0.1  # of the machine's memory, per rank
CUDA_CONTEXT = 512 * 2**20  # a process's CUDA context and kernels, outside torch's pool
RAM_MARGIN = 2**30  # left available on a CPU machine whatever the share says
CGROUP = Path("/sys/fs/cgroup")


def kv_budget_from_memory(device: torch.device, utilization: float | None,
                          activation_bytes: int, full_batch_bytes: int) -> int:
    """Bytes of KV cache for one rank on `device` (0 when memory is short)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        share = GPU_SHARE if utilization is None else utilization
        own = torch.cuda.memory_reserved(device) + CUDA_CONTEXT
        budget = min(int(share * total) - own, free) - activation_bytes
        where = (f"{share:g} of {total / 2**30:.1f} GiB on {device}, {own / 2**30:.1f} GiB "
                 f"this process's, {free / 2**30:.1f} GiB free")
    else:
        total, available = ram_bytes()
        share = CPU_SHARE if utilization is None else utilization
        budget = min(int(share * total), available - RAM_MARGIN, full_batch_bytes)
        where = (f"{share:g} of {total / 2**30:.1f} GiB RAM, {available / 2**30:.1f} "
                 f"available, at most a full batch's {full_batch_bytes / 2**20:.0f} MiB")
    budget = max(budget, 0)
    log.info("KV cache sized from memory: %.0f MiB (%s)", budget / 2**20, where)
    return budget


def ram_bytes() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory, or of its cgroup's limit."""
    info = {line.split(":")[0]: int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines() if line.endswith("kB")}
    total, available = info["MemTotal"], info["MemAvailable"]
    limit = _cgroup_value("memory.max")
    if limit is not None:
        used = _cgroup_value("memory.current") or 0
        total, available = min(total, limit), min(available, limit - used)
    return total, available


def _cgroup_value(name: str) -> int | None:
    """A cgroup v2 memory figure of this process's cgroup; None: no limit or no cgroup."""
    try:
        own = Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip()
        value = (CGROUP / own.lstrip("/") / name).read_text().strip()
    except (OSError, IndexError):
        return None
    return None if value == "max" else int(value)
