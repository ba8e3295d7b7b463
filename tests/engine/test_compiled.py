"""The compiled forward (--compile): the same logits as eager, greedy output token for
token the eager step's (target and draft compiled in one process, speculative rounds,
ragged batches, prefill chunks, a sliding window), and eager serving with one log line
when compiling fails."""

from __future__ import annotations

import logging

import pytest
import torch

from outrider.core.sampling import SamplingParams
from outrider.engine.compiled import CompiledForward
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ForwardRequest, ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import save_random_checkpoint
from tests.engine.test_speculative import ragged_prompts
from tests.toolchain import needs_compiler

# compiling takes 10-30 s a model alone; cold, beside make test's other workers, the
# pair's first compile took over the suite's 300 s per test (a fresh clone, 2026-12-01)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def compiled_pair(llama_dir, draft_dir):
    target = ModelRunner(RunnerConfig(str(llama_dir), compile=True))
    draft = ModelRunner(RunnerConfig(str(draft_dir), compile=True))
    assert isinstance(target.step, CompiledForward) and target.step.is_compiled
    assert isinstance(draft.step, CompiledForward) and draft.step.is_compiled
    return target, draft


def _two_forwards(runner: ModelRunner) -> list[torch.Tensor]:
    """A ragged prefill (1, 5, 3 and 9 tokens), then 1-5 new tokens after each."""
    g = torch.Generator().manual_seed(0)
    logits = []
    for step, lengths in enumerate([(1, 5, 3, 9), (1, 5, 2, 4)]):
        requests = []
        for k, length in enumerate(lengths):
            cached = runner.blocks.seq_len(k) if step else 0
            runner.blocks.append(k, length)
            tokens = torch.randint(3, 200, (length,), generator=g).tolist()
            requests.append(ForwardRequest(tokens, cached, runner.blocks.block_table(k),
                                           min(length, 2 + step)))
        logits.append(runner.forward(requests))
    return logits


@needs_compiler
def test_compiled_logits_equal_eager(llama_dir, compiled_pair):
    target, _ = compiled_pair
    eager = ModelRunner(RunnerConfig(str(llama_dir)))
    try:
        for compiled, reference in zip(_two_forwards(target), _two_forwards(eager),
                                       strict=True):
            torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-4)
        assert target.step.is_compiled, target.step.failure  # compiled ran, not eager twice
    finally:
        for k in range(4):
            target.blocks.free(k)


@needs_compiler
def test_compiled_speculative_greedy_equals_eager(llama_dir, draft_dir, compiled_pair):
    target, draft = compiled_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eager = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))))
    reference = [s.output_ids for s in eager.generate(ragged_prompts(), params, gamma=0)]
    for gamma in (0, 4):
        decoder = SpeculativeDecoder(target, Drafter(draft))
        seqs = decoder.generate(ragged_prompts(), params, gamma=gamma)
        assert [s.output_ids for s in seqs] == reference, gamma
    assert target.step.is_compiled and draft.step.is_compiled  # no silent fallback


@needs_compiler
def test_compiled_sliding_window_and_chunked_prefill(tmp_path):
    model_dir = save_random_checkpoint(tmp_path, "mistral", seed=11, sliding_window=24,
                                       head_dim=16)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 60)), [5, 6, 7]]
    outputs = []
    for compiled in (False, True):
        runner = ModelRunner(RunnerConfig(str(model_dir), compile=compiled))
        decoder = SpeculativeDecoder(runner)
        seqs = [decoder.new_sequence(p, params) for p in prompts]
        while not all(s.is_finished for s in seqs):  # prompts fed 16 tokens a step
            running = [s for s in seqs if not s.is_finished]
            decoder.step(running, [0] * len(running), [16] * len(running))
        outputs.append([s.output_ids for s in seqs])
    assert isinstance(runner.step, CompiledForward) and runner.step.is_compiled, \
        runner.step.failure  # the second run compiled and stayed compiled
    assert outputs[0] == outputs[1]


class _Untraceable(torch.nn.Module):
    """A forward the compiler refuses under fullgraph (a graph break)."""

    def forward(self, input_ids, positions, kv_caches, meta, logits_rows):
        torch._dynamo.graph_break()
        return input_ids.float() * 2


def test_compile_failure_serves_eagerly_with_one_log_line(caplog):
    step = CompiledForward(_Untraceable(), "untraceable")
    ids = torch.arange(4)
    with caplog.at_level(logging.WARNING, logger="outrider.engine.compiled"):
        first = step(ids, ids, [], None, ids)
        second = step(ids, ids, [], None, ids)
    assert torch.equal(first, ids.float() * 2) and torch.equal(second, first)
    assert not step.is_compiled and step.failure
    warnings = [r for r in caplog.records if "serving eagerly" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
