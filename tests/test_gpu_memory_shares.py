"""GPU memory shares (no GPU needed: the device's figures are stood in for by
monkeypatching torch.cuda's two queries): each process sizes its KV cache from its own
share of the device, and `outrider serve` splits the whole share between its processes.
Before, a share was what the device may be filled to, whoever filled it: on one GPU the
draft replica, started first, would take 0.9 of it and leave the target no KV cache."""

import pytest
import torch

from outrider.engine import memory
from outrider.local_system import DRAFT_GPU_SHARE, LocalSystemConfig, gpu_shares

GIB = 2**30


@pytest.fixture
def gpu(monkeypatch):
    """An 80 GiB device: `used` GiB held by other processes, `own` GiB by this one."""
    def device(used: float, own: float) -> torch.device:
        free = int((80 - used - own) * GIB)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, 80 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: int(own * GIB))
        return torch.device("cuda", 0)
    return device


def test_a_process_takes_its_own_share_whatever_others_hold(gpu):
    activation = GIB
    alone = memory.kv_budget_from_memory(gpu(used=0, own=2), 0.8, activation, 0)
    beside = memory.kv_budget_from_memory(gpu(used=8, own=2), 0.8, activation, 0)
    expected = int(0.8 * 80 * GIB) - 2 * GIB - memory.CUDA_CONTEXT - activation
    assert alone == beside == expected


def test_a_share_beyond_what_is_free_gets_what_is_free_less_the_forward_s_room(gpu):
    budget = memory.kv_budget_from_memory(gpu(used=70, own=2), 0.9, GIB, 0)
    assert budget == 8 * GIB - GIB
    assert memory.kv_budget_from_memory(gpu(used=79, own=1), 0.9, GIB, 0) == 0


def flags(cfg: LocalSystemConfig, drafts: int) -> tuple[float | None, float | None]:
    return tuple(float(f[1]) if f else None for f in gpu_shares(cfg, drafts))


def test_serve_splits_one_gpu_between_its_processes():
    cfg = LocalSystemConfig("t", "d", device="cuda", draft_replicas=2)
    draft, target = flags(cfg, 2)
    assert draft == pytest.approx(0.9 * DRAFT_GPU_SHARE / 2, abs=1e-4)
    assert 2 * draft + target == pytest.approx(0.9, abs=1e-4)
    two_targets = LocalSystemConfig("t", None, device="cuda:0", target_replicas=2,
                                    memory_utilization=0.6)
    assert flags(two_targets, 0) == (None, pytest.approx(0.3))
    two_models = LocalSystemConfig("t", None, device="cuda:0", also_serve=("u",),
                                   memory_utilization=0.6)  # (--also-serve: one replica)
    assert flags(two_models, 0) == (None, pytest.approx(0.3))
    two_drafts = LocalSystemConfig("t", "d", device="cuda:0", also_draft=("e",),
                                   memory_utilization=0.6)  # (a target replica each)
    draft, target = flags(two_drafts, 2)
    assert 2 * draft + 2 * target == pytest.approx(0.6, abs=1e-4)


def test_on_a_cpu_the_flag_is_passed_on_as_given():
    assert flags(LocalSystemConfig("t", "d", device="cpu"), 1) == (None, None)
    given = LocalSystemConfig("t", "d", device="cpu", memory_utilization=0.2)
    assert flags(given, 1) == (0.2, 0.2)
