"""Structured outputs in the engine (docs/DESIGN.md §3.8), on the shipped demo pair: the
grammar masks the target's p at every verification row (after the drafts before it) and
the draft's q at every drafted position; a drafted token outside the grammar is rejected,
never emitted. Greedy output with speculation is the constrained target's alone, whatever
proposes; every finished output matches its constraint; one cut by max_tokens is a valid
prefix."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from outrider import paths
from outrider.core.grammar import Grammars
from outrider.core.sampling import SamplingParams
from outrider.core.sequence import FinishReason, ProposerKind, Round
from outrider.core.stats import MODEL_METHOD, SpecStats
from outrider.core.structured import StructuredOutput, StructuredOutputError
from outrider.core.tokenizer import Tokenizer
from outrider.engine.drafter import Drafter
from outrider.engine.mix import ProposerMix
from outrider.engine.proposer import DraftItem
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import RequestError, Row, SpeculativeDecoder, _round_of

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "size": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}}}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-3]\d"
CHOICES = ("alpha", "beta", "gamma delta")
# bounded, so that outputs end (and are checked whole) within MAX_TOKENS
SUM_GRAMMAR = 'start: num " + " num (" + " num)? " = " num\nnum: /[1-9][0-9]?/'
CPU = torch.device("cpu")
CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", DATE),
    "choice": StructuredOutput("choice", CHOICES),
    "grammar": StructuredOutput("grammar", SUM_GRAMMAR),
}
PROMPTS = ["def load(path):\n    config = ", "The date of the release was ", "import os\n"]
MAX_TOKENS = 40
# the constraints whose greedy outputs repeat themselves, so that a lookup finds a match (a
# choice is one word, a sum a few numbers; a schema's structure is forced by its grammar)
REPEATING = ("json_object", "regex")


def allowed_tokens(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed masks [rows, words] int32 (bit t of word t // 32: token t) -> [rows, vocab]
    bool."""
    bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(paths.demo_target_dir())


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return ModelRunner(RunnerConfig(str(paths.demo_target_dir()), kv_cache_mb=64))


@pytest.fixture(scope="module")
def drafter() -> Drafter:
    return Drafter(ModelRunner(RunnerConfig(str(paths.demo_draft_dir()), kv_cache_mb=64)))


def decoder_for(target, drafter, kind: ProposerKind) -> SpeculativeDecoder:
    model = drafter if kind in (ProposerKind.MODEL, ProposerKind.AUTO) else None
    return SpeculativeDecoder(target, ProposerMix(model, target.vocab_size, kind),
                              overlap_max_seqs=2)


def run(decoder, tokenizer, so, gamma: int, temperature: float = 0.0, seed: int = 0):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed + i,
                             structured_output=so) for i in range(len(PROMPTS))]
    seqs = decoder.generate([tokenizer.encode(p) for p in PROMPTS], params, gamma=gamma)
    assert decoder.target.blocks.num_used_blocks == 0
    assert not decoder.grammars._sequences  # every finished sequence let its matcher go
    return seqs


def check_output(name: str, seq, tokenizer) -> None:
    """A stopped output matches its constraint whole; a cut one is a prefix the grammar
    allows."""
    output = seq.output_ids
    if seq.finish_reason is FinishReason.LENGTH:
        grammars = Grammars(tokenizer.path, tokenizer.vocab_size, [0])
        mask = grammars.next_mask("check", CONSTRAINTS[name], output, 0, ())
        assert allowed_tokens(mask[None], tokenizer.vocab_size).any(), (name, output)
        assert not grammars._sequences["check"].is_broken, (name, tokenizer.decode(output))
        return
    assert seq.finish_reason is FinishReason.STOP and output[-1] == 0, seq.finish_reason
    text = tokenizer.decode(output[:-1])
    if name == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "size", "tags"} and isinstance(value["size"], int)
        assert len(value["name"]) <= 12 and set(value["tags"]) <= {"a", "b"}
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(DATE, text), text
    elif name == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,2} = [1-9][0-9]?", text), text


def check_outputs(name: str, seqs, tokenizer) -> None:
    """check_output for each, and at least one stopped: a whole match was checked."""
    for seq in seqs:
        check_output(name, seq, tokenizer)
    assert any(s.finish_reason is FinishReason.STOP for s in seqs), [s.output_ids for s in seqs]


@pytest.mark.parametrize("kind", [ProposerKind.MODEL, ProposerKind.NGRAM, ProposerKind.SUFFIX])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_greedy_with_speculation_is_the_constrained_target_alone(target, drafter, tokenizer,
                                                                  name, kind):
    """The lookups propose without the grammar, so their tokens outside it are rejected
    in verification; the model drafts inside it."""
    decoder = decoder_for(target, drafter, kind)
    alone = run(decoder, tokenizer, CONSTRAINTS[name], gamma=0)
    speculative = run(decoder, tokenizer, CONSTRAINTS[name], gamma=4)
    assert [s.output_ids for s in speculative] == [s.output_ids for s in alone]
    check_outputs(name, speculative, tokenizer)
    stats = SpecStats()
    for s in speculative:
        stats.merge(s.stats)
    method = MODEL_METHOD if kind is ProposerKind.MODEL else kind.value
    if kind is ProposerKind.MODEL or name in REPEATING:
        assert stats.by_proposer[method][0] > 0, stats.by_proposer  # it proposed
    if kind is ProposerKind.MODEL:  # drafting inside the grammar, many are kept (outside
        # it, next to none would be)
        assert stats.num_accepted_tokens >= stats.num_draft_tokens / 4, stats


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_sampled_outputs_match_their_constraint(target, drafter, tokenizer, name):
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    seqs = run(decoder, tokenizer, CONSTRAINTS[name], gamma=4, temperature=0.9, seed=7)
    check_outputs(name, seqs, tokenizer)
    assert all(seq.stats.num_draft_tokens > 0 for seq in seqs)


def test_unconstrained_outputs_would_not_match(target, drafter, tokenizer):
    """Without this the constrained tests could pass on outputs the model gives anyway."""
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    outputs = [tokenizer.decode(s.output_ids) for s in run(decoder, tokenizer, None, gamma=4)]
    assert not any(re.fullmatch(DATE, o) or o in CHOICES for o in outputs), outputs


def test_a_resumed_sequence_continues_under_its_grammar(target, drafter, tokenizer):
    """The matcher is rebuilt from the committed tokens (a failover resume)."""
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    so = CONSTRAINTS["json_schema"]
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=so)
    prompt = tokenizer.encode(PROMPTS[0])
    whole = decoder.generate([prompt], params, gamma=4)[0].output_ids
    seq = decoder.new_sequence(prompt, params, resume_ids=whole[:9])
    while not seq.is_finished:
        decoder.step([seq], [4])
    assert seq.output_ids == whole


def test_logprobs_are_after_the_mask(target, drafter, tokenizer, grammars):
    """Alternatives the grammar forbids are not reported (no -inf in an answer)."""
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    so = CONSTRAINTS["choice"]
    params = SamplingParams(max_tokens=8, logprobs=20, structured_output=so)
    seq = decoder.generate([tokenizer.encode(PROMPTS[1])], params, gamma=4)[0]
    allowed = set(allowed_tokens(fresh_mask(grammars, so, [])[None],
                                 tokenizer.vocab_size)[0].nonzero()[0].tolist())
    first = {t for t, _ in seq.logprobs[0].top}
    assert first and first <= allowed and len(first) == min(20, len(allowed)), (first, allowed)
    assert all(np.isfinite(lp) for entry in seq.logprobs for _, lp in entry.top)


def test_a_constraint_that_does_not_compile_is_refused(target, drafter):
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    for so, problem in ((StructuredOutput("regex", "[a-"), "structured_output.regex"),
                        (StructuredOutput("grammar", "start: nowhere"),
                         "structured_output.grammar"),
                        (StructuredOutput("json_schema", "{not json"),
                         "structured_output.json_schema")):
        with pytest.raises(RequestError, match=re.escape(problem)):
            decoder.new_sequence([1, 2, 3], SamplingParams(structured_output=so))


def test_bad_constraints_are_named():
    for kwargs, problem in ((dict(kind="xml"), "kind must be one of"),
                            (dict(kind="choice", value=()), "structured_output.choice"),
                            (dict(kind="choice", value=("a", "")), "a choice is empty"),
                            (dict(kind="regex", value=""), "structured_output.regex is empty"),
                            (dict(kind="grammar", value="x" * 70_000), "at most")):
        with pytest.raises(StructuredOutputError, match=re.escape(problem)):
            StructuredOutput(**kwargs)


# -- the masks themselves ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer.path, tokenizer.vocab_size, [0])


def fresh_mask(grammars: Grammars, so: StructuredOutput, tokens: list[int]) -> np.ndarray:
    """The mask after `tokens`, from a matcher that never rolled back."""
    key = object()
    try:
        return grammars.next_mask(key, so, tokens, 0, ())
    finally:
        grammars.release(key)


def test_row_masks_follow_the_drafts_and_roll_back(grammars, tokenizer):
    """Rows agree with fresh matchers over many rounds of a sequence, each round's
    drafts partly valid, partly outside the grammar, partly taken back."""
    so = CONSTRAINTS["json_schema"]
    text = '{"name":"ab","size":12,"tags":["a","b"]}'
    valid = tokenizer.encode(text)
    rng = np.random.default_rng(0)
    for committed in range(0, len(valid) - 2, 3):
        output = valid[:committed]
        drafted = valid[committed:committed + 3] + [int(rng.integers(tokenizer.vocab_size))]
        masks = grammars.row_masks("seq", so, output, 0, drafted)
        for j in range(len(drafted) + 1):
            prefix = output + drafted[:j]
            if j <= 3 and committed + j <= len(valid):
                np.testing.assert_array_equal(masks[j], fresh_mask(grammars, so, prefix))
        # the drafter's row after the drafts, on the same matcher
        np.testing.assert_array_equal(grammars.next_mask("seq", so, output, 0, drafted[:2]),
                                      fresh_mask(grammars, so, output + drafted[:2]))
    grammars.release("seq")


def test_a_token_outside_the_grammar_masks_itself_out(grammars, tokenizer):
    so = CONSTRAINTS["choice"]
    bad = tokenizer.encode("zzz")[0]
    masks = grammars.row_masks("seq", so, [], 0, [bad, bad])
    allowed = allowed_tokens(masks, tokenizer.vocab_size)
    assert not allowed[0, bad]  # the row that verifies it refuses it
    assert allowed[1:].nonzero()[1].tolist() == [0, 0]  # rows after it: never used
    grammars.release("seq")


def test_committed_tokens_outside_the_grammar_end_the_output(grammars, tokenizer):
    so = CONSTRAINTS["regex"]
    masks = grammars.row_masks("seq", so, tokenizer.encode("hello"), 0, [])
    assert allowed_tokens(masks, tokenizer.vocab_size)[0].nonzero()[0].tolist() == [0]
    grammars.release("seq")


def test_a_finished_grammar_allows_only_eos(grammars, tokenizer):
    """Also after EOS itself, and after EOS drafted twice (ignore_eos: EOS goes on)."""
    beta = tokenizer.encode("beta")
    mask = grammars.next_mask("seq", CONSTRAINTS["choice"], beta, 0, ())
    assert allowed_tokens(mask[None], tokenizer.vocab_size)[0].nonzero()[0].tolist() == [0]
    masks = grammars.row_masks("seq", CONSTRAINTS["choice"], beta, 0, [0, 0, 0])
    assert allowed_tokens(masks, tokenizer.vocab_size).nonzero()[1].tolist() == [0] * 4
    masks = grammars.row_masks("seq", CONSTRAINTS["choice"], [*beta, 0, 0], 0, [0])
    assert allowed_tokens(masks, tokenizer.vocab_size).nonzero()[1].tolist() == [0] * 2
    grammars.release("seq")


def test_the_grammar_forces_what_has_one_way_on(grammars, tokenizer):
    """A schema's opening and its next key are forced; drafted tokens count as taken
    (without becoming output); nothing is forced in free text or after a refused token."""
    so = CONSTRAINTS["json_schema"]
    assert tokenizer.decode(grammars.forced_tokens("seq", so, [], 0)) == '{"name":'
    named = tokenizer.encode('{"name":"x"')
    assert tokenizer.decode(grammars.forced_tokens("seq", so, named, 0)) == ',"size":'
    assert tokenizer.decode(grammars.forced_tokens("seq", so, [], 0, named)) == ',"size":'
    assert grammars.forced_tokens("seq", so, tokenizer.encode('{"name":"'), 0) == []
    assert grammars.forced_tokens("seq", so, [], 0, tokenizer.encode("zzz")) == []
    grammars.release("seq")


def test_forced_tokens_are_proposed_on_top_of_gamma(target, drafter, tokenizer):
    """They lead rounds whatever proposes, beyond the model's γ (rounds longer than γ),
    counted as the grammar's; the output is still the constrained target's alone."""
    so = CONSTRAINTS["json_schema"]
    for kind in (ProposerKind.MODEL, ProposerKind.NGRAM):
        decoder = decoder_for(target, drafter, kind)
        alone = run(decoder, tokenizer, so, gamma=0)
        speculative = run(decoder, tokenizer, so, gamma=2)
        assert [s.output_ids for s in speculative] == [s.output_ids for s in alone]
        stats = SpecStats()
        for s in speculative:
            stats.merge(s.stats)
        forced, kept = stats.by_proposer["grammar"]
        assert forced >= 3 * len(PROMPTS) and kept == forced, stats.by_proposer  # greedy
        assert len(stats.drafted_per_position) > 2, stats  # a round proposed more than γ


def test_a_round_drafts_ahead_its_models_share_not_its_forced_tokens(target, drafter,
                                                                     tokenizer):
    """Drafting the next round during verification (overlap) asks the draft for this
    round's γ less the tokens its grammar forced on top of it, + the bonus-position
    candidate: the next round's forced tokens come on top of its γ again."""
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    asked = []
    submit = decoder.drafter.submit

    def recorded(items, device, beside_target=False):
        if beside_target:
            asked.append([it.gamma for it in items])
        return submit(items, device, beside_target)

    decoder.drafter.submit = recorded
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=CONSTRAINTS["json_schema"])
    seq = decoder.new_sequence(tokenizer.encode(PROMPTS[0]), params)
    forced_rounds = 0
    while not seq.is_finished:
        asked.clear()
        decoder.step([seq], [2])
        r = seq.last_round
        gamma, kind, num_free = r.gamma, r.free_kind, r.num_free
        if asked and kind == "grammar" and gamma > num_free:
            forced_rounds += 1
            assert asked == [[gamma - num_free + 1]], (seq.last_round, asked)
    decoder.release(seq)
    assert forced_rounds, "no round had forced tokens and model drafts"


def test_the_first_round_proposes_the_grammars_opening(target, drafter, tokenizer):
    """A schema's opening (`{"name":"`) is forced: the first round verifies it with the
    prefill, so the first chunk holds it (no draft call: the draft takes in the context
    meanwhile). Not while speculation is off (γ 0); the output is the target's alone."""
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    prompt = tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=CONSTRAINTS["json_schema"])
    chunks = [tokens for _, tokens in decoder.stream(prompt, params, gamma=4)]
    first = chunks[0]
    assert tokenizer.decode(first).startswith('{"name":"') and len(first) > 2, first
    opening = len(first) - 1
    alone = decoder.generate([prompt], params, gamma=0)[0]
    assert [t for c in chunks for t in c] == alone.output_ids
    assert len(next(decoder.stream(prompt, params, gamma=0))[1]) == 1
    # the draft took in the prompt, not the opening: the sequence says so, so its next
    # Propose is no MISS (a mix keeps its own count: the model alone shows it)
    alone_with_model = SpeculativeDecoder(target, drafter, overlap_max_seqs=2)
    seq = alone_with_model.new_sequence(prompt, params)
    alone_with_model.step([seq], [4])
    assert seq.last_round == Round(opening, opening, "grammar", opening)
    misses = drafter.num_misses
    alone_with_model.step([seq], [4])
    assert drafter.num_misses == misses and seq.last_round.gamma > 0
    alone_with_model.release(seq)


def test_a_complete_grammar_ends_the_output_in_the_round_that_completes_it(target, drafter,
                                                                            tokenizer):
    """Once the grammar takes EOS alone, EOS is committed with the token that completed
    it: no round of its own (one would be a whole target forward for a known token). With
    logprobs the EOS stays the target's row; with ignore_eos the output goes on; min_tokens
    does not hold it back (the constraint wins). The output is the target's alone."""
    decoder = decoder_for(target, drafter, ProposerKind.MODEL)
    prompt = tokenizer.encode("DEBUG = ")
    boolean = StructuredOutput("choice", ("True", "False", "None"))
    params = SamplingParams(max_tokens=8, structured_output=boolean)
    chunks = [tokens for _, tokens in decoder.stream(prompt, params, gamma=0)]
    assert len(chunks[-1]) == 2 and chunks[-1][-1] == 0, chunks     # one token a round
    assert all(len(c) == 1 for c in chunks[:-1]), chunks
    with_logprobs = SamplingParams(max_tokens=8, structured_output=boolean, logprobs=2)
    assert [c for _, c in decoder.stream(prompt, with_logprobs, gamma=0)] == [
        *chunks[:-1], chunks[-1][:1], [0]]
    going_on = SamplingParams(max_tokens=8, structured_output=boolean, ignore_eos=True)
    assert decoder.generate([prompt], going_on, gamma=0)[0].num_output == 8
    output = [t for c in chunks for t in c]
    for temperature in (0.0, 0.9):   # min_tokens past a complete grammar: it ends valid
        longer = SamplingParams(max_tokens=8, structured_output=boolean, min_tokens=6,
                                temperature=temperature, seed=3)
        for gamma in (0, 4):
            seq = decoder.generate([prompt], longer, gamma=gamma)[0]
            assert seq.finish_reason is FinishReason.STOP and seq.output_ids[-1] == 0
            assert tokenizer.decode(seq.output_ids[:-1]) in boolean.value, seq.output_ids
            if temperature == 0:
                assert seq.output_ids == output
    for name, so in CONSTRAINTS.items():   # speculating: never a round for EOS alone
        for text in PROMPTS:
            params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=so)
            rounds = [c for _, c in decoder.stream(tokenizer.encode(text), params, gamma=4)]
            assert [0] not in rounds, (name, text, rounds)
    assert decoder.target.blocks.num_used_blocks == 0 and not decoder.grammars._sequences


def test_forced_tokens_past_the_reserved_kv_wait_when_the_cache_is_full(target, drafter,
                                                                        tokenizer):
    """Forced tokens ride on top of γ, past the KV the scheduler reserved (the fed tokens
    + γ): with no room beyond that, the round keeps its first γ proposals instead of
    failing every sequence in the step; the output is the target's alone."""
    small = ModelRunner(RunnerConfig(str(paths.demo_target_dir()), block_size=4,
                                     kv_cache_mb=1))
    decoder = SpeculativeDecoder(small, ProposerMix(drafter, small.vocab_size,
                                                    ProposerKind.MODEL), overlap_max_seqs=2)
    one_way = StructuredOutput("choice", ("alpha beta gamma delta epsilon zeta eta theta",))
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=one_way)
    prompt = tokenizer.encode(PROMPTS[1])
    alone = decoder.generate([prompt], params, gamma=0)[0].output_ids
    seq = decoder.new_sequence(prompt, params)
    decoder.step([seq], [1])
    blocks = small.blocks  # leave exactly what the scheduler would reserve: feed + γ
    blocks.append("filler", (blocks.num_free_blocks - blocks.blocks_needed(
        seq.seq_id, seq.num_pending + 1)) * blocks.block_size)
    assert len(decoder._forced(seq, 1, [])) > 1   # more than γ is forced next
    decoder.step([seq], [1])
    assert seq.last_round.gamma == 1
    blocks.free("filler")
    while not seq.is_finished:
        decoder.step([seq], [1])
    assert seq.output_ids == alone


def test_a_round_counts_only_what_the_output_could_hold():
    """Proposals after the token that ends an output (EOS, a stop token, a finished
    grammar's EOS drafted again and again) were never a chance to be kept: the round
    ends there for its statistics."""
    row = Row(0, seq=None, feed=1, is_ready=True, is_first=False, wanted=6, gamma=6,
              source=("grammar", 2))
    assert _round_of(row, 6, 7) == Round(6, 6, "grammar", 2)     # ended at the bonus
    assert _round_of(row, 2, 3) == Round(6, 2, "grammar", 2)     # rejected at row 2
    assert _round_of(row, 6, 3) == Round(3, 3, "grammar", 2)     # ended at proposal 3
    assert _round_of(row, 4, 1) == Round(1, 1, "grammar", 1)     # ... at the first
    looked_up = Row(0, seq=None, feed=1, is_ready=True, is_first=False, wanted=6, gamma=5,
                    source=("suffix", 5))
    assert _round_of(looked_up, 5, 2) == Round(2, 2, "suffix", 2)


def test_a_lookup_keeps_to_the_grammar(grammars, tokenizer):
    """The n-gram lookup would copy " 1234" and the line after it; under a regex of a
    number the mix proposes the number and stops where the grammar refuses the newline
    (and the model, if any, drafts from there)."""
    so = StructuredOutput("regex", r" \d+")
    prompt = tokenizer.encode("x = 1234\ny = 5\nx =")
    params = SamplingParams(temperature=0.0, structured_output=so)
    proposed = {}
    for name, mix_grammars in (("with", grammars), ("without", None)):
        mix = ProposerMix(None, tokenizer.vocab_size, ProposerKind.NGRAM, grammars=mix_grammars)
        out = mix.draft([DraftItem(name, 0, prompt, 6, params, seed=0,
                                   prompt_len=len(prompt))], CPU)
        proposed[name] = tokenizer.decode(out.token_ids[0, :out.gammas[0]].tolist())
        mix.release(name)
    assert proposed["without"].startswith(" 1234\n")  # what the lookup alone copies
    assert proposed["with"] == " 1234"
    assert not grammars._sequences  # the lookups' matcher went with its sequence


def test_the_draft_compiles_a_grammar_as_it_takes_in_the_context(drafter, tokenizer):
    """Not in the sequence's first drafting round, whose time the target's cost model
    weighs (a compile there scaled the draft's estimated time up)."""
    so = StructuredOutput("regex", r"[a-f]{3,9} # warm")  # compiled nowhere else here
    params = SamplingParams(temperature=0.0, structured_output=so)
    prompt = tokenizer.encode("colour = ")
    assert so.key not in drafter.grammars._compiled
    out = drafter.draft([DraftItem("warm", 0, prompt, 0, params, seed=0, prefill_only=True,
                                   prompt_len=len(prompt))], CPU)
    assert out.is_miss == [False] and so.key in drafter.grammars._compiled
    drafter.release("warm")
