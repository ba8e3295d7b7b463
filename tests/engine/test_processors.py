"""The request's logits processors (logit_bias, min_tokens, penalties, min_p) against
transformers' own, and end to end through the speculative loop: greedy output equals
target-only output, logprobs equal transformers', and a draft with a shorter context."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from outrider.core.sampling import GREEDY_BELOW, History, SamplingParams
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.sampling import logits_to_probs, probs_of, processed_logits
from outrider.engine.spec_decode import SpeculativeDecoder
from tests.checkpoints import VOCAB

ALL = 1 << 30  # draft ahead however big the batch
EOS = 2        # tests/checkpoints.py: eos_token_id


def ragged_prompts(n: int = 6, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1 + 7 * i,), generator=g).tolist() for i in range(n)]


# -- processed_logits against transformers' processors ----------------------------------------

SMALL_VOCAB = 48


def _hf_processed(logits: torch.Tensor, p: SamplingParams, h: History) -> torch.Tensor:
    """One row through transformers' processors, in vLLM's order; frequency and presence
    (no transformers equivalent) by the OpenAI formula, over the output tokens only."""
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([[*h.token_ids, *h.drafted]], dtype=torch.long)
    scores = logits[None].clone()
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in p.logit_bias])(
            ids, scores)
    if p.min_tokens and p.held_back_ids:
        scores = MinNewTokensLengthLogitsProcessor(h.prompt_len, p.min_tokens,
                                                   list(p.held_back_ids))(ids, scores)
    if p.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, scores)
    output = [*h.token_ids[h.prompt_len:], *h.drafted]
    for t in set(output):
        scores[0, t] = (scores[0, t] - p.frequency_penalty * output.count(t)
                        - p.presence_penalty)
    if not p.is_greedy:
        scores = TemperatureLogitsWarper(float(p.temperature))(ids, scores)
        if p.min_p:
            scores = MinPLogitsWarper(float(p.min_p))(ids, scores)
        if p.top_k:
            scores = TopKLogitsWarper(p.top_k)(ids, scores)
        if p.top_p < 1:
            scores = TopPLogitsWarper(float(p.top_p))(ids, scores)
    return scores[0]


def _random_params(g: torch.Generator, vocab: int) -> SamplingParams:
    def uniform(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=g).item()

    def maybe(value, default):
        return value if torch.rand((), generator=g).item() < 0.6 else default

    ids = torch.randperm(vocab, generator=g)[:3].tolist()
    stops = tuple(ids[:int(torch.randint(0, 3, (), generator=g))])
    is_greedy = torch.rand((), generator=g).item() < 0.3
    return SamplingParams(
        max_tokens=64,
        temperature=0.0 if is_greedy else uniform(0.3, 1.7),
        top_k=maybe(int(torch.randint(1, vocab, (), generator=g)), 0),
        top_p=maybe(uniform(0.3, 0.99), 1.0),
        min_p=maybe(uniform(0.01, 0.3), 0.0),
        repetition_penalty=maybe(uniform(0.5, 2.0), 1.0),
        frequency_penalty=maybe(uniform(-2.0, 2.0), 0.0),
        presence_penalty=maybe(uniform(-2.0, 2.0), 0.0),
        logit_bias=maybe(tuple((t, uniform(-100.0, 100.0)) for t in ids[1:]), ()),
        min_tokens=maybe(int(torch.randint(0, 12, (), generator=g)), 0),
        stop_token_ids=stops,
        ignore_eos=torch.rand((), generator=g).item() < 0.3,
        eos_token_ids=(ids[2],),
    )


def _random_batch(seed: int, vocab: int = SMALL_VOCAB):
    """Rows as the speculative loop builds them: a sequence's γ+1 rows share its token
    list, row j adds the round's first j draft tokens."""
    g = torch.Generator().manual_seed(seed)
    params, histories = [], []
    for _ in range(6):
        p = _random_params(g, vocab)
        prompt_len = int(torch.randint(1, 10, (), generator=g))
        num_output = int(torch.randint(0, 10, (), generator=g))
        # few distinct ids: tokens repeat in the prompt and in the output
        token_ids = torch.randint(0, vocab // 3, (prompt_len + num_output,), generator=g).tolist()
        drafts = torch.randint(0, vocab // 3, (4,), generator=g).tolist()
        for j in range(int(torch.randint(1, 5, (), generator=g))):
            params.append(p)
            histories.append(History(token_ids, prompt_len, tuple(drafts[:j])))
    logits = torch.randn(len(params), vocab, generator=g) * 4
    return logits, params, histories


@pytest.mark.parametrize("seed", range(8))
def test_processed_logits_equal_transformers_processors(seed):
    logits, params, histories = _random_batch(seed)
    processed = processed_logits(logits, params, histories)
    for i, (p, h) in enumerate(zip(params, histories)):
        expected = _hf_processed(logits[i], p, h)
        is_finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(processed[i]), is_finite), (i, p, h)
        assert (processed[i][~is_finite] == -math.inf).all()
        torch.testing.assert_close(processed[i][is_finite], expected[is_finite],
                                   atol=1e-5, rtol=0, msg=lambda m, i=i: f"row {i}: {m}")


def test_random_batches_exercise_every_processor():
    """The random cases above are not vacuous: each processor changed some row."""
    rows = [(logits[i], p, h) for seed in range(8)
            for logits, ps, hs in [_random_batch(seed)] for i, (p, h) in enumerate(zip(ps, hs))]
    changed = {name: False for name in ("bias", "min_tokens", "repetition", "frequency",
                                        "presence", "min_p", "top_k", "top_p")}
    for logits, p, h in rows:
        def only(temperature=0.0, p=p, **kw):
            return SamplingParams(max_tokens=64, temperature=temperature,
                                  eos_token_ids=p.eos_token_ids, stop_token_ids=p.stop_token_ids,
                                  ignore_eos=p.ignore_eos, **kw)

        cases = {"bias": only(logit_bias=p.logit_bias), "min_tokens": only(min_tokens=p.min_tokens),
                 "repetition": only(repetition_penalty=p.repetition_penalty),
                 "frequency": only(frequency_penalty=p.frequency_penalty),
                 "presence": only(presence_penalty=p.presence_penalty)}
        if not p.is_greedy:
            t = p.temperature
            cases.update({"min_p": only(t, min_p=p.min_p), "top_k": only(t, top_k=p.top_k),
                          "top_p": only(t, top_p=p.top_p)})
        for name, q in cases.items():
            plain = processed_logits(logits[None], [only(q.temperature)], [h])
            if not torch.equal(processed_logits(logits[None], [q], [h]), plain):
                changed[name] = True
    assert all(changed.values()), changed


def test_frequency_and_presence_count_output_and_drafted_tokens_only():
    """logit - f * count - p * (count > 0), over the output after the prompt and the
    round's earlier draft tokens; prompt tokens are not counted."""
    vocab = 10
    logits = torch.arange(vocab, dtype=torch.float32)[None].repeat(3, 1)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    token_ids = [1, 1, 2, 3, 3, 3]  # prompt [1, 1, 2], output [3, 3, 3]
    rows = [History(token_ids, 3, ()), History(token_ids, 3, (4,)), History(token_ids, 3, (4, 3))]
    out = processed_logits(logits, [p] * 3, rows)
    for row, h in zip(out.tolist(), rows):
        output = [*token_ids[3:], *h.drafted]
        expected = [t - 0.5 * output.count(t) - 0.25 * (t in output) for t in range(vocab)]
        assert row == pytest.approx(expected, abs=1e-6)
    assert out[2, 3] == pytest.approx(3 - 0.5 * 4 - 0.25)


# -- truncation and the greedy threshold -------------------------------------------------------

def test_untruncated_row_keeps_its_whole_tail_beside_a_truncating_row():
    """A top_p = 1, top_k = 0 row whose fp32 cumulative sum reaches 1.0 before its tail,
    batched beside a top-k/top-p row, keeps every token."""
    vocab = 1000
    peaked = torch.full((vocab,), -17.0)
    peaked[1:] += torch.linspace(0, -0.5, vocab - 1)
    peaked[0] = 0.0
    cumsum = peaked.softmax(-1).sort(descending=True).values.cumsum(-1)
    first_one = int((cumsum >= 1.0).nonzero()[0])
    assert first_one < vocab - 10  # precondition: the fp32 sum hits 1.0 before the tail
    other = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    whole = SamplingParams(temperature=1.0)
    truncating = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    for params in ([whole, truncating], [truncating, whole]):
        logits = torch.stack([peaked, other] if params[0] is whole else [other, peaked])
        row = params.index(whole)
        processed = processed_logits(logits, params)
        assert torch.isfinite(processed[row]).all()
        torch.testing.assert_close(processed[row], peaked)
        probs = logits_to_probs(logits, params)
        assert (probs[row] > 0).all()
        assert int(torch.isfinite(processed[1 - row]).sum()) <= 5


@pytest.mark.parametrize("temperature", [0.0, 9.999999e-6, GREEDY_BELOW, 1.0000001e-5, 1e-4])
def test_point_mass_iff_is_greedy_at_the_threshold(temperature):
    """Two tied top logits: a greedy row is a point mass, a sampled one (however cold)
    splits between them. Alone and batched beside greedy and sampled rows."""
    logits = torch.tensor([[0.5, 3.0, 3.0, -1.0, 2.0]])
    params = SamplingParams(temperature=temperature)
    batch = torch.cat([logits, logits, logits])
    batch_params = [SamplingParams(), params, SamplingParams(temperature=1.0)]
    for probs in (logits_to_probs(logits, [params])[0],
                  probs_of(processed_logits(logits, [params]), [params])[0],
                  logits_to_probs(batch, batch_params)[1],
                  probs_of(processed_logits(batch, batch_params), batch_params)[1]):
        assert torch.isfinite(probs).all()
        assert float(probs.sum()) == pytest.approx(1.0)
        is_point_mass = bool((probs == 1.0).any())
        assert is_point_mass == params.is_greedy, (temperature, probs)
        if not params.is_greedy:
            assert probs[1].item() == pytest.approx(0.5) and probs[2].item() == pytest.approx(0.5)


# -- greedy speculative output with processors -------------------------------------------------

PROCESSED = [
    SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=32, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.5),
    SamplingParams(max_tokens=32, ignore_eos=True, logit_bias=((5, 3.0), (17, -100.0))),
    SamplingParams(max_tokens=32, min_tokens=12, logit_bias=((EOS, 4.0),),
                   repetition_penalty=1.2, frequency_penalty=0.3),
    SamplingParams(max_tokens=32, ignore_eos=True),
    SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=0.8,
                   presence_penalty=-0.5, frequency_penalty=0.2, logit_bias=((40, 1.5),)),
]


@pytest.fixture(scope="module")
def target_decoder(llama_dir):
    return SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))))


@pytest.fixture(scope="module")
def processed_target_only(target_decoder):
    return [s.output_ids for s in target_decoder.generate(ragged_prompts(), PROCESSED, gamma=0)]


@pytest.fixture(scope="module", params=["plain", "overlap"])
def spec_decoder(request, llama_dir, draft_dir):
    return SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                              Drafter(ModelRunner(RunnerConfig(str(draft_dir)))),
                              overlap_max_seqs=ALL if request.param == "overlap" else 0)


def test_processors_change_the_greedy_output(target_decoder, processed_target_only):
    """The processors are not vacuous here: they change what greedy decoding emits."""
    plain = SamplingParams(max_tokens=32, ignore_eos=True)
    unprocessed = [s.output_ids for s in target_decoder.generate(ragged_prompts(), plain, 0)]
    changed = [a != b for a, b in zip(processed_target_only, unprocessed)]
    assert changed == [True, True, True, True, False, True]


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_speculative_greedy_with_processors_equals_target_only(spec_decoder,
                                                               processed_target_only, gamma):
    seqs = spec_decoder.generate(ragged_prompts(), PROCESSED, gamma=gamma)
    assert [s.output_ids for s in seqs] == processed_target_only
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    assert spec_decoder.target.blocks.num_used_blocks == 0
    assert spec_decoder.drafter.runner.blocks.num_used_blocks == 0


@pytest.mark.parametrize("gamma", [0, 3])
def test_min_tokens_holds_eos_back_then_lets_it_through(spec_decoder, gamma):
    prompts = ragged_prompts()[:4]
    params = SamplingParams(max_tokens=30, min_tokens=5, logit_bias=((EOS, 100.0),))
    for s in spec_decoder.generate(prompts, params, gamma=gamma):
        assert EOS not in s.output_ids[:5]
        assert s.output_ids[5:] == [EOS] and s.finish_reason == "stop"
    # without min_tokens the same bias ends the request at once
    unheld = SamplingParams(max_tokens=30, logit_bias=((EOS, 100.0),))
    assert [s.output_ids for s in spec_decoder.generate(prompts, unheld, gamma)] == [[EOS]] * 4


@pytest.mark.parametrize("gamma", [0, 3])
def test_min_tokens_holds_stop_tokens_back(spec_decoder, gamma):
    stop = 77
    params = SamplingParams(max_tokens=30, min_tokens=9, ignore_eos=True, stop_token_ids=(stop,),
                            logit_bias=((stop, 100.0),))
    for s in spec_decoder.generate(ragged_prompts()[:4], params, gamma=gamma):
        assert stop not in s.output_ids[:9]
        assert s.output_ids[9:] == [stop] and s.finish_reason == "stop"
    assert spec_decoder.target.blocks.num_used_blocks == 0
    assert spec_decoder.drafter.runner.blocks.num_used_blocks == 0


# -- logprobs against transformers -------------------------------------------------------------

def _hf_logprob_rows(model_dir, prompt: list[int], output: list[int], p: SamplingParams):
    """log_softmax of transformers' processed scores at each output position, from one HF
    forward over prompt + output."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    model = _hf_model(model_dir, AutoModelForCausalLM)
    full = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(full).logits[0].float()  # [len, vocab]
    rows = []
    for n in range(len(output)):
        ids, scores = full[:, :len(prompt) + n], logits[len(prompt) + n - 1][None]
        if p.repetition_penalty != 1:
            scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, scores)
        if not p.is_greedy:
            scores = TemperatureLogitsWarper(float(p.temperature))(ids, scores)
            if p.top_k:
                scores = TopKLogitsWarper(p.top_k)(ids, scores)
        rows.append(torch.log_softmax(scores[0], -1))
    return rows


_HF_MODELS: dict = {}


def _hf_model(model_dir, auto_cls):
    key = str(model_dir)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = auto_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_MODELS[key]


LOGPROB_GREEDY = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                                logprobs=5)
LOGPROB_SAMPLED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_k=20,
                                 seed=11, logprobs=5)


@pytest.mark.parametrize("batch", ["greedy", "mixed"])
def test_logprobs_equal_transformers(spec_decoder, llama_dir, batch):
    prompts = ragged_prompts()[1:5]
    params = ([LOGPROB_GREEDY] * 4 if batch == "greedy" else
              [LOGPROB_GREEDY, LOGPROB_SAMPLED, LOGPROB_GREEDY,
               dataclasses.replace(LOGPROB_SAMPLED, seed=12)])
    seqs = spec_decoder.generate(prompts, params, gamma=4)
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    for prompt, p, s in zip(prompts, params, seqs):
        assert len(s.logprobs) == len(s.output_ids) == p.max_tokens
        reference = _hf_logprob_rows(llama_dir, prompt, s.output_ids, p)
        for n, (lp, ref) in enumerate(zip(s.logprobs, reference)):
            token = s.output_ids[n]
            assert lp.token_id == token
            if p.is_greedy:
                assert token == int(ref.argmax()), n
            assert math.isfinite(lp.logprob)
            assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-4), (n, p)
            top_lp, top_ids = ref.topk(p.logprobs)
            assert [t for t, _ in lp.top] == top_ids.tolist(), n
            assert [v for _, v in lp.top] == pytest.approx(top_lp.tolist(), abs=1e-4), n


# -- a draft with a shorter context than the target --------------------------------------------

DRAFT_CONTEXT = 32


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_generation_goes_on_past_the_drafts_context(llama_dir, draft_dir, target_decoder,
                                                    overlap):
    drafter = Drafter(ModelRunner(RunnerConfig(str(draft_dir), max_model_len=DRAFT_CONTEXT)))
    assert drafter.max_model_len == DRAFT_CONTEXT
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))), drafter,
                                 overlap_max_seqs=ALL if overlap else 0)
    assert decoder.max_model_len > DRAFT_CONTEXT + 40
    g = torch.Generator().manual_seed(9)
    # longer than the draft's context; crosses it while generating; stays well inside
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (45, 20, 3)]
    params = SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.1)
    expected = [s.output_ids for s in target_decoder.generate(prompts, params, gamma=0)]
    seqs = decoder.generate(prompts, params, gamma=4)
    assert [s.output_ids for s in seqs] == expected
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert [len(s.output_ids) for s in seqs] == [30] * 3
    assert seqs[0].stats.num_draft_tokens == 0  # never speculated
    assert seqs[1].stats.num_draft_tokens > 0 and seqs[2].stats.num_draft_tokens > 0
    assert decoder.target.blocks.num_used_blocks == 0
    assert drafter.runner.blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def self_draft_decoder(llama_dir):
    """The target drafting for itself: with q built as p is, every draft token passes."""
    return SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir))),
                              Drafter(ModelRunner(RunnerConfig(str(llama_dir)))),
                              overlap_max_seqs=ALL)


def test_logprobs_with_accepted_bonus_candidates_equal_target_only(self_draft_decoder,
                                                                    target_decoder):
    """Overlap with a draft that is always right: bonus-position candidates are accepted
    (γ + 2 tokens verified per round, the last sequence of the batch included), and
    each token still gets exactly one logprob, the target-only one."""
    prompts = ragged_prompts()[2:5]
    params = dataclasses.replace(LOGPROB_GREEDY, max_tokens=24)
    before = self_draft_decoder.num_ahead_rounds
    seqs = self_draft_decoder.generate(prompts, params, gamma=2)
    assert self_draft_decoder.num_ahead_rounds > before
    expected = target_decoder.generate(prompts, params, gamma=0)
    for s, e in zip(seqs, expected):
        assert s.output_ids == e.output_ids
        assert [lp.token_id for lp in s.logprobs] == s.output_ids
        assert [lp.logprob for lp in s.logprobs] == pytest.approx(
            [lp.logprob for lp in e.logprobs], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in s.logprobs] == [
            [t for t, _ in lp.top] for lp in e.logprobs]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_draft_identical_to_target_is_always_accepted_under_processors(self_draft_decoder,
                                                                       sampled):
    """The draft applies the processors over the same history as the target (prompt,
    output, the round's earlier drafts; min_tokens counting them), so a draft with the
    target's weights proposes from q = p and every token passes."""
    params = [dataclasses.replace(p, temperature=0.9, top_k=40, min_p=0.02, seed=i)
              if sampled else p for i, p in enumerate(PROCESSED)]
    seqs = self_draft_decoder.generate(ragged_prompts(), params, gamma=4)
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    accepted = sum(s.stats.num_accepted_tokens for s in seqs)
    assert drafted > 50
    if sampled:
        assert accepted >= 0.98 * drafted  # p / q is 1 up to fp32 rounding
    else:
        assert accepted == drafted


def test_resumed_tokens_count_as_output_for_the_penalties(spec_decoder, target_decoder):
    """A request resumed after k tokens continues as the uninterrupted one does: the
    resumed tokens are output for the frequency/presence penalties and min_tokens."""
    prompt = ragged_prompts()[3]
    params = SamplingParams(max_tokens=24, frequency_penalty=1.5, presence_penalty=1.0,
                            min_tokens=16, logit_bias=((EOS, 8.0),))
    full = target_decoder.generate([prompt], params, gamma=0)[0].output_ids
    assert len(full) >= 17 and EOS not in full[:16]
    seq = spec_decoder.new_sequence(prompt, params, resume_ids=full[:10])
    while not seq.is_finished:
        spec_decoder.step([seq], [3])
    assert seq.output_ids == full
