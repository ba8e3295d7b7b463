"""An adapting draft replica learns from what the target sends it over the wire: the
target's top-k at every committed position (asked for by the replica that trains), and
the target counts acceptance by the draft weights' version that drafted."""

from __future__ import annotations

import time

import pytest
from outrider.draft_worker.main import DraftWorkerConfig, start
from outrider.target_worker.remote_drafter import RemoteDrafter

from outrider.core.sampling import SamplingParams
from outrider.engine.distill import DistillConfig, trainable_copy
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder

TOKEN = "adapt-wire-token"


@pytest.fixture()
def adapting(draft_dir):
    cfg = DraftWorkerConfig(str(draft_dir), kv_cache_mb=8, adapt=True,
                            distill=DistillConfig(round_tokens=10**9, target_topk=4))
    running = start(cfg, TOKEN)
    try:
        yield running
    finally:
        running.service.adapter.stop()
        running.stop(0)


def test_the_trainer_gets_the_targets_topk_at_committed_positions(adapting, llama_dir):
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=8))
    remote = RemoteDrafter([adapting.address], TOKEN, "t0-")
    decoder = SpeculativeDecoder(target, remote)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(9)] for i in range(3)]
    seqs = decoder.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), gamma=3)
    assert remote.target_topk == 4  # the replica asked, from its first reply on
    buffer = adapting.service.adapter.buffer
    deadline = time.monotonic() + 10
    while buffer.num_added < 3 and time.monotonic() < deadline:  # Release is async
        time.sleep(0.05)
    served = [*buffer.train, *buffer.heldout]
    assert len(served) == 3
    for s in served:
        outputs = range(s.prompt_len, len(s.token_ids))
        t = s.teacher
        rows = dict(zip(t.positions.tolist(), zip(t.ids.tolist(), t.logprobs.tolist())))
        # every output token the draft was sent but those of the first round (sent
        # before the replica's first reply asked for them)
        assert len(rows) >= len(outputs) - 4 and set(rows) <= set(outputs)
        for p, (ids, lps) in rows.items():
            assert len(ids) == 4 and list(lps) == sorted(lps, reverse=True)
            assert ids[0] == s.token_ids[p]  # greedy: the target's likeliest token
    # a new version drafts: the target learns which from the replies
    adapter = adapting.service.adapter
    assert adapter.adopt(trainable_copy(adapter.drafter.runner).state_dict())
    running = decoder.new_sequence(prompts[0], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        decoder.step([running], [3])
    assert remote.version == 1 and decoder.draft_version(running) == 1
    while not running.is_finished:
        decoder.step([running], [3])
    assert running.output_ids == seqs[0].output_ids
    remote.close()
