"""Draft versions shared through a real Redis (draft_worker/versions.py): one replica of a
pair trains and publishes, the others pull; a trainer that goes hands over; a trainer
that lost its lease cannot publish."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from outrider.draft_worker.adapt import Adapter
from outrider.draft_worker.versions import KEEP_VERSIONS, SharedVersions

from outrider import paths
from outrider.client import Client
from outrider.engine.distill import DistillConfig, trainable_copy
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.launch import free_port
from outrider.local_system import LocalSystemConfig, local_system
from outrider.state import RedisStore
from tests.checkpoints import save_random_checkpoint
from tests.scraping import scrape, total


def replica(model_dir, redis_url: str, pair: str, lease_s: float = 30.0) -> Adapter:
    drafter = Drafter(ModelRunner(RunnerConfig(str(model_dir), kv_cache_mb=4)))
    shared = SharedVersions(RedisStore(redis_url), pair, lease_s=lease_s)
    return Adapter(drafter, threading.Lock(), DistillConfig(), shared=shared)


def nudged(adapter: Adapter, scale: float) -> dict:
    weights = trainable_copy(adapter.drafter.runner).state_dict()
    return {k: (v + scale * torch.ones_like(v)).detach() for k, v in weights.items()}


def test_one_replica_trains_and_the_others_pull_its_versions(tmp_path, redis_url):
    save_random_checkpoint(tmp_path, seed=3)
    first, second = (replica(tmp_path, redis_url, "pull") for _ in range(2))
    first.tick()
    second.tick()
    assert first.is_trainer and not second.is_trainer  # one lease per pair
    new = nudged(first, 0.01)
    assert first.adopt(new) and first.drafter.version == 1
    second.tick()
    assert second.drafter.version == 1
    pulled = second.drafter.runner.build_model(second.state).state_dict()
    for name, value in new.items():
        torch.testing.assert_close(pulled[name], value.to(pulled[name].dtype))
    for _ in range(KEEP_VERSIONS + 1):
        first.adopt(nudged(first, 0.02))
    assert first.shared.latest() == KEEP_VERSIONS + 2
    assert first.shared.fetch(1) is None  # only the newest versions are kept
    assert first.shared.fetch(KEEP_VERSIONS + 2) is not None


def test_a_trainer_that_goes_hands_over_and_a_stale_one_cannot_publish(tmp_path, redis_url):
    save_random_checkpoint(tmp_path, seed=4)
    # (a lease long enough for an adoption on a loaded 2-core machine: 0.3 s lapsed
    # during the first one in a fresh clone's make test)
    first, second = (replica(tmp_path, redis_url, "handover", lease_s=2.0) for _ in range(2))
    first.tick()
    assert first.is_trainer and first.adopt(nudged(first, 0.01))
    second.tick()
    assert not second.is_trainer and second.drafter.version == 1
    time.sleep(2.5)  # the trainer stopped renewing: its lease lapses
    second.tick()
    assert second.is_trainer
    assert not first.adopt(nudged(first, 0.02))  # it no longer holds the lease
    assert not first.is_trainer and first.drafter.version == 1
    assert second.adopt(nudged(second, 0.03)) and second.drafter.version == 2
    first.tick()
    assert first.drafter.version == 2


def test_without_redis_a_replica_keeps_serving_what_it_has(tmp_path):
    save_random_checkpoint(tmp_path, seed=5)
    gone = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    lonely = replica(tmp_path, gone, "gone")
    lonely._thread.start()  # the loop survives StoreUnavailable
    time.sleep(1.2)
    assert lonely._thread.is_alive() and lonely.drafter.version == 0
    lonely.stop()


@pytest.mark.slow
def test_serve_with_redis_has_one_trainer_and_counts_acceptance_by_version(redis_url):
    """`outrider serve --adapt --redis`: of two draft replicas exactly one trains (and asks
    the target for its top-k); the target counts acceptance under the draft's version,
    and every round a client sees says which version drafted it."""
    target, draft = str(paths.demo_target_dir()), str(paths.demo_draft_dir())
    cfg = LocalSystemConfig(target, draft, draft_replicas=2, grpc_port=0, metrics=True,
                            adapt=True, redis_url=redis_url)
    with local_system(cfg) as system, Client(system.router, timeout_s=120) as client:
        results = [client.generate(f"def f{i}(x):\n    return", max_tokens=24,
                                   temperature=0.0, speculation="fixed", gamma_max=4,
                                   include_rounds=True) for i in range(4)]
        drafts = [scrape(system.metrics[f"draft-{i}"]) for i in range(2)]
        served = scrape(system.metrics["target"])
    assert sorted(total(d, "outrider_draft_trainer") for d in drafts) == [0.0, 1.0]
    rounds = [r for g in results for r in g.rounds if r.gamma]
    assert rounds and {r.draft_version for r in rounds} == {0}
    drafted = total(served, "outrider:spec_decode_draft_tokens_by_version_total",
                    draft_version="0")
    accepted = total(served, "outrider:spec_decode_accepted_tokens_by_version_total",
                     draft_version="0")
    # by version: the model's drafts only, not tokens the suffix lookup proposed (§2.8)
    assert drafted == sum(r.gamma - r.num_free for r in rounds)
    assert accepted == sum(max(0, r.num_accepted - r.num_free) for r in rounds)
