"""Token trees (outrider/engine/tree.py, docs/DESIGN.md §8.9): the masks and the walk,
then trees drafted by a draft model and by an EAGLE head for greedy requests and verified
by the target in one forward: greedy output is the target's alone, and sampled requests'
trees (siblings drawn without replacement) are verified by recursive rejection sampling,
exact in distribution (the distribution grid's tree case is in
test_spec_distribution.py)."""

from __future__ import annotations

import pytest
import torch

from outrider.core.sampling import SamplingParams
from outrider.core.sequence import ProposerKind
from outrider.core.tokenizer import Tokenizer
from outrider.engine.drafter import Drafter
from outrider.engine.heads import head_proposer
from outrider.engine.mix import ProposerMix
from outrider.engine.rejection import tree_rejection_sample
from outrider.engine.runner import (
    MOVE_KV,
    ForwardRequest,
    ModelRunner,
    RunnerConfig,
    decode_requests,
    encode_requests,
)
from outrider.engine.spec_decode import RequestError, SpeculativeDecoder
from outrider.engine.tree import (
    MASK_BITS,
    TreeChoice,
    TreeShape,
    chain,
    row_tree,
    tree_masks,
    walk,
)
from outrider.paths import models_dir

SHAPES = [TreeShape(2, 6), TreeShape(4, 20), TreeShape(3)]


def seen_by_walking(parents: list[int], node: int) -> int:
    """The mask by definition: itself, its ancestors, and the context (keys before node 0)."""
    seen, walk_to = {node}, parents[node]
    while walk_to != -1:
        seen.add(walk_to)
        walk_to = parents[walk_to]
    return sum(1 << d for d in range(MASK_BITS) if node - d < 0 or node - d in seen)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 1, 2, 5, 5, 3], chain(70),
                                     [-1, -1, -1, 0, 1, 2, 3, 6]])
def test_masks_see_ancestors_and_context(parents):
    masks = tree_masks(parents)
    assert all(m & (1 << MASK_BITS) - 1 == seen_by_walking(parents, n)
               for n, m in enumerate(masks))


def test_a_rows_tree_follows_its_fed_tokens():
    """Two fed tokens then a tree: positions are depths after them, and a chain row needs
    no mask (-1: causal)."""
    offsets, masks = row_tree(2, [-1, -1, 0, 1])
    assert offsets == [0, 1, 2, 2, 3, 3]
    assert masks[:3] == [-1, -1, -1] and masks[3] != -1
    assert row_tree(1, chain(4))[1] == [-1] * 5


def test_the_walk_follows_the_targets_choices():
    parents, tokens = [-1, -1, 0, 1, 1], [5, 6, 7, 8, 9]
    assert walk(parents, tokens, [6, 0, 9, 0, 0, 0]) == [1, 4]  # 6, then 9 under it
    assert walk(parents, tokens, [7, 0, 0, 0, 0, 0]) == []      # no child is 7
    assert walk(parents, tokens, [5, 7, 0, 1, 0, 0]) == [0, 2]


def test_tree_shapes_count_what_the_target_verifies():
    assert TreeShape(1).width(5) == 5 and TreeShape(4).width(3) == 4 + 2 * 16
    assert TreeShape(4, 20).width(8) == 20 and TreeShape(2, 20).width(1) == 2
    for bad in [dict(topk=0), dict(tokens=-1), dict(tokens=MASK_BITS)]:
        with pytest.raises(ValueError):
            TreeShape(**bad)


def test_forwards_with_trees_and_kv_moves_cross_to_other_ranks():
    requests = [ForwardRequest([1, 2, 3], 4, [0, 1], 3, tree=row_tree(1, [-1, -1])),
                ForwardRequest([7], 9, [2], 1)]
    decoded = decode_requests(encode_requests(requests).tolist())
    assert [(r.token_ids, r.cached_len, r.block_table, r.num_logits, r.tree)
            for r in decoded] == [(r.token_ids, r.cached_len, r.block_table, r.num_logits,
                                   r.tree) for r in requests]
    assert decode_requests([MOVE_KV, 2, 10, 11, 3, 4]) == ([10, 11], [3, 4])


@pytest.fixture(scope="module")
def demo():
    """The shipped pair and head (trained: their drafts are often kept, and trees keep
    branches past the first child), and prompts of code."""
    models = models_dir()
    target = ModelRunner(RunnerConfig(str(models / "demo-target"), dtype="float32",
                                      kv_cache_mb=32))
    tokenizer = Tokenizer(models / "demo-target")
    prompts = [tokenizer.encode(text) for text in CODE]
    return target, prompts, models


CODE = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push"]


def proposer(kind: str, target: ModelRunner, models):
    if kind == "draft":
        return Drafter(ModelRunner(RunnerConfig(str(models / "demo-draft"), dtype="float32",
                                                kv_cache_mb=16)))
    head = head_proposer(RunnerConfig(str(models / "demo-eagle3"), kv_cache_mb=8), target)
    return ProposerMix(head, target.vocab_size, ProposerKind.AUTO) if kind == "head-auto" \
        else head


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["draft", "head", "head-auto"])
def test_greedy_trees_give_the_target_alone(kind, shape, demo):
    """Three prompts in one batch, γ 3 deep, twice (the second time with every prompt's
    KV cached, and the suffix lookup beside the head finding the first run's outputs):
    the target's greedy output, rounds that keep branches off the first child (KV and a
    head's features moved), and every KV block back."""
    target, prompts, models = demo
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = SpeculativeDecoder(target).generate(prompts, params, gamma=0)
    decoder = SpeculativeDecoder(target, proposer(kind, target, models), overlap_max_seqs=8,
                                 tree=shape, choose_trees=False)
    assert decoder.overlap_max_seqs == 0  # a tree's drafts are not drafted ahead
    off_first_child = []
    step = decoder._walk_trees

    def noted(step_, ready, *args):
        out = step(step_, ready, *args)
        off_first_child.extend(any(n > d for d, n in enumerate(r.path or [])) for r in ready)
        return out
    decoder._walk_trees = noted
    for _ in range(2):
        out = decoder.generate(prompts, params, gamma=3)
        assert [s.token_ids for s in out] == [s.token_ids for s in alone]
        assert max(len(s.stats.drafted_per_position) for s in out) <= 3  # γ: the depth
    assert any(off_first_child)
    assert target.blocks.num_used_blocks == 0


def test_recursive_rejection_sampling_gives_the_targets_distribution():
    """Three children drawn from q without replacement, each tested in turn against what
    p has become: the first token committed follows p, whatever q is (a q far from p,
    and one that misses a token p likes). 8,000 draws: a frequency 4.5 σ off fails."""
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])
    for q in (torch.tensor([0.5, 0.05, 0.3, 0.05, 0.0, 0.1]), torch.full((6,), 1 / 6)):
        counts = torch.zeros(6)
        for _ in range(8000):
            left, kids = q.clone(), []
            for _ in range(3):  # (what the Drafter's draws are: engine/drafter.py)
                x = int(torch.multinomial(left, 1, generator=gen))
                kids.append(x)
                left[x] = 0
            u = torch.rand(2, 3, generator=gen, dtype=torch.float64)
            path, final = tree_rejection_sample(
                [-1, -1, -1], kids, torch.stack([p] * 4), torch.stack([q] * 3), u,
                torch.rand(2, generator=gen, dtype=torch.float64))
            counts[kids[path[0]] if path else final] += 1
        assert (counts / 8000 - p).abs().max() < 4.5 * (0.25 / 8000) ** 0.5, counts


def test_greedy_and_sampled_trees_share_a_batch(demo):
    """Greedy and sampled requests (truncation, penalties over each node's own path,
    logprobs) in one batch of trees: the greedy ones give the target's output, the
    sampled ones accept drafts past the first child and report a logprob per token."""
    target, prompts, models = demo
    sampled = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11 + i,
                              repetition_penalty=1.2, presence_penalty=0.4, logprobs=2,
                              ignore_eos=True) for i in range(len(prompts))]
    greedy = [SamplingParams(max_tokens=20, ignore_eos=True)] * len(prompts)
    alone = SpeculativeDecoder(target).generate(prompts, greedy, gamma=0)
    decoder = SpeculativeDecoder(target, proposer("draft", target, models),
                                 tree=TreeShape(3, 12), choose_trees=False)
    paths = []
    walk_trees = decoder._walk_trees

    def noted(step, ready, *args):
        walk_trees(step, ready, *args)
        paths.extend(r.path for r in ready if not r.seq.params.is_greedy and r.path)
    decoder._walk_trees = noted
    out = decoder.generate(prompts * 2, sampled + greedy, gamma=4)
    assert [s.output_ids for s in out[len(prompts):]] == [s.output_ids for s in alone]
    assert any(n > d for path in paths for d, n in enumerate(path))  # off the first child
    for s in out[:len(prompts)]:  # one logprob per token, the token's own among its top
        assert [lp.token_id for lp in s.logprobs] == s.output_ids
    assert target.blocks.num_used_blocks == 0


def test_a_request_chooses_its_tree_within_the_replicas(demo):
    """Requests' own shapes in one batch of a decoder verifying trees of top-k 3 and 12
    nodes: a chain (top-k 1), a smaller tree (2, 5) and the decoder's. Greedy output is
    the target's alone; the chain's rounds verify no tree, the smaller tree's at most 5
    nodes; a shape past the decoder's is refused naming what it verifies."""
    target, prompts, models = demo
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = SpeculativeDecoder(target).generate(prompts, params, gamma=0)
    decoder = SpeculativeDecoder(target, proposer("draft", target, models),
                                 tree=TreeShape(3, 12), choose_trees=False)
    seqs = [decoder.new_sequence(p, params) for p in prompts]
    for seq, shape in zip(seqs, [(1, 0), (2, 5), (0, 0)]):
        seq.tree = decoder.request_tree(*shape)
    nodes: list[list[int]] = [[] for _ in seqs]
    while not all(s.is_finished for s in seqs):
        running = [s for s in seqs if not s.is_finished]
        decoder.step(running, [4] * len(running))
        for s in running:
            nodes[seqs.index(s)].append(s.last_round.tree_nodes)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in alone]
    assert not any(nodes[0]) and 0 < max(nodes[1]) <= 5 and max(nodes[2]) > 5, nodes
    assert decoder.request_tree(0, 0) is None  # the decoder's own
    for shape, what in [((4, 0), "tree_topk 4, tree_tokens 12"),
                        ((2, 13), "tree_topk 2, tree_tokens 13")]:
        with pytest.raises(ValueError, match=f"{what}.*verifies trees of top-k 3 and 12"):
            decoder.request_tree(*shape)
    with pytest.raises(ValueError, match="verifies chains"):
        SpeculativeDecoder(target, proposer("draft", target, models)).request_tree(2, 0)
    assert target.blocks.num_used_blocks == 0


def test_greedy_steps_draft_the_kind_with_more_goodput():
    """TreeChoice: each kind measured first; then a tree that keeps no more than its own
    chain loses (12 more positions to verify) and is tried after 8 steps, then 16; one
    that keeps 2 more a round wins at one request but not at 32, where every position
    verified costs a share of the step."""
    choice = TreeChoice()
    verify = lambda n: 0.004 + 0.0002 * n  # noqa: E731 (seconds for n positions)
    assert choice.use_tree(1, 4, 16, verify)
    choice.observe_round(True, 3, 3)
    choice.observe_draft(True, 1, 0.004)
    assert not choice.use_tree(1, 4, 16, verify)
    choice.observe_round(False, 3, 3)
    choice.observe_draft(False, 1, 0.003)
    picks = [choice.use_tree(1, 4, 16, verify) for _ in range(8 + 16)]
    assert [i for i, p in enumerate(picks) if p] == [7, 23]
    for _ in range(60):
        choice.observe_round(True, 5, 3)
    assert choice.use_tree(1, 4, 16, verify)
    assert not choice.use_tree(32, 4, 16, verify)


def test_trees_are_refused_for_a_sliding_window_target(tmp_path, llama_dir, draft_dir):
    import json
    import shutil
    windowed = shutil.copytree(llama_dir, tmp_path / "windowed")
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps(
        {**config, "architectures": ["MistralForCausalLM"], "sliding_window": 8}))
    target = ModelRunner(RunnerConfig(str(windowed), dtype="float32", kv_cache_mb=8))
    drafts = Drafter(ModelRunner(RunnerConfig(str(draft_dir), dtype="float32", kv_cache_mb=8)))
    with pytest.raises(RequestError, match="sliding window"):
        SpeculativeDecoder(target, drafts, tree=TreeShape(2))
    assert SpeculativeDecoder(target, drafts, tree=TreeShape(1)).tree is None  # a chain


def test_kv_moves_copy_every_layer(demo):
    """move_kv puts position src's keys and values at dst in every layer."""
    target = demo[0]
    blocks = target.blocks
    blocks.append("moves", 40)
    table = blocks.block_table("moves")
    try:
        target.forward([ForwardRequest(list(range(3, 43)), 0, table, 1)])
        bs = target.cfg.block_size
        slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
        before = [(k[table[35 // bs], :, :, 35 % bs].clone(), v[slot(35)].clone())
                  for k, v in target.kv_caches]
        target.move_kv(table, [(35, 20)])
        for (k, v), (k35, v35) in zip(target.kv_caches, before):
            assert torch.equal(k[table[20 // bs], :, :, 20 % bs], k35)
            assert torch.equal(v[slot(20)], v35)
    finally:
        blocks.free("moves")
