"""Drafts with a tokenizer of their own (outrider/engine/cross_vocab.py): text crosses
between the vocabularies with nothing lost or duplicated, greedy output is the target's,
a tokenizer that cannot carry the target's text is refused. (Sampled rows: the
chi-square suite, test_spec_distribution.py.)"""

from __future__ import annotations

import ast
import json
import random

import pytest

from outrider.core.sampling import SamplingParams
from outrider.core.stats import CROSS_VOCAB_METHOD, MODEL_METHOD
from outrider.core.tokenizer import Tokenizer, vocab_fingerprint
from outrider.engine.cross_vocab import (
    CrossVocabDrafter,
    TextBridge,
    _Context,
    pair_bridge,
)
from outrider.engine.drafter import Drafter
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import RequestError, SpeculativeDecoder
from tests.checkpoints import permuted_vocab_copy, train_tokenizer

VOCAB = 320  # the session's checkpoints' (tokenizers hold 300 or fewer)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory, tokenizer_dir) -> TextBridge:
    """The session's tokenizer (json's source) to one of another size trained on
    another module's: other merges, other ids."""
    other = train_tokenizer(tmp_path_factory.mktemp("other_tokenizer"), 280, module=ast)
    return TextBridge(Tokenizer(tokenizer_dir), Tokenizer(other), VOCAB, VOCAB)


def text_of(tok: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes(i) for i in ids)


def test_the_drafts_context_is_the_committed_text_round_after_round(bridge):
    """Random target tokens (any segmentation, bytes that are not UTF-8 included)
    committed and rolled back over many rounds: the draft's context always spells the
    committed bytes but for a last character begun, re-encoded from an anchor only."""
    rng = random.Random(0)
    ctx = _Context()
    words = list(bridge.target.vocab.values())
    for _ in range(60):
        ctx.truncate(max(0, len(ctx.target) - rng.randrange(6)))
        bridge.extend(ctx, [rng.choice(words) for _ in range(rng.randrange(1, 9))]
                      + [rng.randrange(VOCAB)])
        bridge.redraft_context(ctx)
        text, spelled = bytes(ctx.text), text_of(bridge.draft, ctx.draft)
        assert text.startswith(spelled) and len(text) - len(spelled) < 4
        assert spelled == text or text[len(spelled)] >= 0xC0  # held back: a character begun
    assert ctx.anchors[-1][0] > len(ctx.target) // 2  # re-encoding starts near the end


def test_drafted_text_becomes_the_targets_tokens_after_the_committed_ones(bridge):
    """The drafted text, re-encoded with the last committed token, gives target tokens
    that spell what follows the committed text (none overlaps it), the last one (which
    more text could change) left out unless the draft ended its text."""
    source = "def loads(s, *, cls=None, object_hook=None):\n    return decoder.decode(s)\n"
    target_ids = bridge.target.encode(source, False)
    num_proposed = 0
    for cut in range(1, len(target_ids) - 2):
        ctx = _Context()
        bridge.extend(ctx, target_ids[:cut])
        committed = bytes(ctx.text)
        rest = source.encode()[len(committed):].decode()
        proposed = bridge.to_target(ctx, bridge.draft.encode(rest, False)[:8], gamma=6)
        assert len(proposed) <= 6
        assert source.encode().startswith(committed + text_of(bridge.target, proposed))
        num_proposed += len(proposed)
    assert num_proposed > 2 * len(target_ids)
    ctx = _Context()
    bridge.extend(ctx, target_ids[:3])
    ended = bridge.to_target(ctx, bridge.draft.encode("x = 1", False) + [2], gamma=8)
    assert text_of(bridge.target, ended[:-1]) == b"x = 1" and ended[-1] == 2  # </s> is one


@pytest.fixture(scope="module")
def cross_draft_dir(tmp_path_factory, draft_dir):
    """The session's draft over shuffled ids: another vocabulary, the same text model."""
    return permuted_vocab_copy(draft_dir, tmp_path_factory.mktemp("cross_draft"))


def test_greedy_output_is_the_targets_and_the_draft_is_kept(llama_dir, cross_draft_dir):
    bridge = pair_bridge(str(llama_dir), str(cross_draft_dir))
    assert bridge is not None  # the tokenizer.json files map tokens to different ids
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=32))
    drafter = CrossVocabDrafter(Drafter(ModelRunner(RunnerConfig(str(cross_draft_dir),
                                                                 kv_cache_mb=32))),
                                bridge, target.vocab_size)
    decoder = SpeculativeDecoder(target, drafter)
    tok = Tokenizer(llama_dir)
    prompts = [tok.encode(text, False) for text in (
        "import json\nfrom collections import", "def encode(self, o):\n    return",
        "class JSONDecodeError(ValueError):\n")]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [s.output_ids for s in decoder.generate(prompts, params, gamma=0)]
    spec = decoder.generate(prompts, params, gamma=4)
    assert [s.output_ids for s in spec] == plain
    accepted = sum(s.stats.num_accepted_tokens for s in spec)
    assert 0 < accepted < sum(s.stats.num_draft_tokens for s in spec)
    assert {m for s in spec for m in s.stats.by_proposer} == {CROSS_VOCAB_METHOD}
    assert target.blocks.num_used_blocks == 0 == drafter.inner.runner.blocks.num_used_blocks


def test_a_tokenizer_that_cannot_carry_the_targets_text_is_refused(llama_dir, tmp_path):
    """A word-level draft tokenizer knows a few words: most target tokens are unknown to
    it. Refused at start, saying why."""
    draft = permuted_vocab_copy(llama_dir, tmp_path / "words")
    words = {w: i for i, w in enumerate(["<unk>", "def", "return", "self"])}
    (draft / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": words, "unk_token": "<unk>"}}))
    with pytest.raises(RequestError, match="cannot carry the target's text: .* target tokens"):
        pair_bridge(str(llama_dir), str(draft))


def test_one_draft_replica_drafts_for_targets_of_two_vocabularies(llama_dir, cross_draft_dir,
                                                                  tmp_path):
    """One replica, --target-model twice: the session's target (another vocabulary: through
    text) and one over the draft's own ids (the draft as it is). Each target, saying its
    vocabulary, gets proposals in its ids, greedy (its own output) and sampled (q over its
    ids in the format it asks), kept by it; a third vocabulary is turned away, naming the
    flag; the speculation cache, which prepares in the draft's ids, is refused."""
    from outrider.draft_worker.main import DraftWorkerConfig, start
    from outrider.target_worker.remote_drafter import DraftReplicaError, RemoteDrafter

    own_vocab = permuted_vocab_copy(llama_dir, tmp_path / "own", seed=2)  # the draft's ids
    cfg = DraftWorkerConfig(str(cross_draft_dir), kv_cache_mb=8,
                            target_models=(str(llama_dir), str(own_vocab)))
    running = start(cfg, "cross-vocab")
    prompts = [[(7 * i + j) % 290 + 3 for j in range(9)] for i in range(3)]
    try:
        for k, target_dir in enumerate((llama_dir, own_vocab)):
            target = ModelRunner(RunnerConfig(str(target_dir), kv_cache_mb=16))
            remote = RemoteDrafter([running.address], "cross-vocab", f"t{k}-",
                                   target_vocab=vocab_fingerprint(str(target_dir)))
            decoder = SpeculativeDecoder(target, remote)
            assert remote.method == (CROSS_VOCAB_METHOD if k == 0 else MODEL_METHOD)
            for params in (SamplingParams(max_tokens=24, ignore_eos=True),
                           SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8,
                                          seed=11)):
                plain = [s.output_ids for s in decoder.generate(prompts, params, gamma=0)]
                spec = decoder.generate(prompts, params, gamma=3)
                assert sum(s.stats.num_accepted_tokens for s in spec) > 0
                if params.is_greedy:
                    assert [s.output_ids for s in spec] == plain
        with pytest.raises(DraftReplicaError, match="2 target vocabularies .* --target-model"):
            RemoteDrafter([running.address], "cross-vocab", "t9-", target_vocab="0" * 16)
    finally:
        running.stop(0)
    with pytest.raises(Exception, match="another vocabulary .* without --speculation-cache"):
        start(DraftWorkerConfig(str(cross_draft_dir), kv_cache_mb=8, speculation_cache=True,
                                target_models=(str(llama_dir),)), "cross-vocab")
