"""docs/DESIGN.md §6: a target replica killed mid-stream; the router resumes the request on the
other replica from prompt + committed tokens, and the client's stream goes on with
nothing lost or repeated."""

from __future__ import annotations

import pytest

from outrider.client import Client
from outrider.core.sampling import SamplingParams
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from outrider.launch import process_group
from tests.processes import two_targets_behind_a_router

pytestmark = pytest.mark.slow
PROMPT = [11, 23, 5, 87, 140, 9]


def test_killed_replica_mid_stream_loses_and_repeats_nothing(llama_dir, draft_dir):
    expected = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir)))).generate(
        [PROMPT], SamplingParams(max_tokens=300, ignore_eos=True), 0)[0].output_ids
    with process_group("t") as start:
        targets, router = two_targets_behind_a_router(start, llama_dir, draft_dir)
        with Client(router, timeout_s=300) as client:
            assert len(client.status().replicas) == 2
            stream = client.stream(PROMPT, max_tokens=300, temperature=0.0, ignore_eos=True,
                                   speculation="fixed", gamma_max=3)
            deltas = iter(stream)
            parts = [next(deltas)]
            targets[parts[0].replica].kill()  # SIGKILL: no goodbye
            parts += list(deltas)
            result = stream.result()
    tokens = [t for p in parts for t in p.token_ids]
    assert tokens == expected == list(result.token_ids)
    assert result.replica != parts[0].replica and result.finish_reason == "length"
    assert result.usage.completion_tokens == 300
