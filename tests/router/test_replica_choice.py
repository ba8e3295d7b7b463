"""How the router chooses a target replica: the cost formula (expected_seconds), the
router's prefix index, and round-robin. Plain Python: replicas are Load records."""

from __future__ import annotations

import pytest
from outrider.router.prefix_index import PrefixIndex, block_chain
from outrider.router.replicas import ReplicaSet, expected_seconds

from outrider.core.policy import Acceptance
from outrider.state import MemoryStore
from outrider.v1 import state_pb2 as st
from outrider.v1 import worker_pb2 as pb

SYSTEM = list(range(1000, 1512))  # a 512-token shared prefix


def load(num_running: int = 0, heat: float = 0.0, caching: bool = True) -> pb.Load:
    cost = pb.CostModel(verify_base_s=0.007, verify_per_token_s=0.00015, knee_tokens=15,
                        draft_per_position_s=0.0007, draft_rtt_s=0.0004,
                        draft_per_token_s=0.0001)
    return pb.Load(num_running=num_running, heat=heat, cost=cost, gamma_max=8,
                   max_batch_tokens=512, kv_total_blocks=4096, block_size=16,
                   prefix_caching=caching)


def replica_set(loads: dict[str, pb.Load], routing: str = "cache-aware") -> ReplicaSet:
    replicas = ReplicaSet(MemoryStore(), list(loads), None, routing=routing)
    replicas._live = {a: st.ReplicaRecord(address=a, load=x) for a, x in loads.items()}
    return replicas


def pick(replicas: ReplicaSet, prompt: list[int], request_id: str = "r") -> str:
    return replicas.pick(lambda pair: Acceptance([0.7] * 8), prompt_ids=prompt, max_tokens=48,
                         request_id=request_id).address


def test_cached_tokens_count_more_on_a_busy_replica():
    a = Acceptance([0.7] * 8)
    idle_saving = (expected_seconds(load(0), a, 500, 48, 0, 0)
                   - expected_seconds(load(0), a, 0, 48, 0, 0))
    busy_saving = (expected_seconds(load(8), a, 500, 48, 8, 0)
                   - expected_seconds(load(8), a, 0, 48, 8, 0))
    assert busy_saving == pytest.approx(9 * idle_saving)


def test_a_conversation_follows_its_cache():
    replicas = replica_set({"a": load(2), "b": load(2)})
    first = pick(replicas, SYSTEM + [7] * 40)
    history = SYSTEM + [7] * 40 + [8] * 48
    replicas.prefilled(first, "r")  # as the service does at the first token ...
    replicas.note_prefix(first, history[:-1])  # ... and when the turn ends
    for turn in range(3):
        history += [9 + turn] * 40
        assert pick(replicas, history) == first
        history += [20 + turn] * 48
        replicas.prefilled(first, "r")
        replicas.note_prefix(first, history[:-1])


def test_a_cold_replica_wins_over_a_crowded_warm_one():
    replicas = replica_set({"warm": load(40, heat=1.5), "cold": load(0)})
    replicas.prefixes.add("warm", block_chain(SYSTEM, 16), 4096)
    assert pick(replicas, SYSTEM + [5] * 40) == "cold"


def test_prefills_still_queued_spread_a_burst():
    replicas = replica_set({"a": load(), "b": load()})
    chosen = [pick(replicas, [i] * 520, f"r{i}") for i in range(8)]  # eight cold prompts
    assert chosen.count("a") == 4 and chosen.count("b") == 4
    for i, address in enumerate(chosen):  # all prefilled: the queue is empty again
        replicas.prefilled(address, f"r{i}")
    assert pick(replicas, [99] * 520, "next") == "a"


def test_a_replica_without_prefix_caching_is_never_credited_with_a_cache():
    replicas = replica_set({"a": load(caching=False), "b": load(1)})
    replicas.prefixes.add("a", block_chain(SYSTEM, 16), 4096)
    assert replicas._cached_tokens(replicas._live["a"], SYSTEM) == 0


def test_round_robin_takes_turns_whatever_the_cache():
    replicas = replica_set({"a": load(), "b": load()}, routing="round-robin")
    assert [pick(replicas, SYSTEM) for _ in range(4)] == ["a", "b", "a", "b"]


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="routing must be one of"):
        ReplicaSet(MemoryStore(), [], None, routing="random")


def test_the_index_matches_leading_blocks_and_forgets_the_least_recent():
    index = PrefixIndex()
    one, two = block_chain(list(range(64)), 16), block_chain(list(range(100, 164)), 16)
    index.add("r", one, capacity=6)
    assert index.num_cached_blocks("r", one) == 4
    assert index.num_cached_blocks("r", block_chain(list(range(32)) + [0] * 32, 16)) == 2
    index.add("r", two, capacity=6)  # 8 blocks > 6: the oldest (deepest of `one`) go
    assert index.num_cached_blocks("r", two) == 4
    assert index.num_cached_blocks("r", one) == 2
    index.forget("r")
    assert index.num_cached_blocks("r", two) == 0


def test_each_served_model_picks_among_its_own_replicas_only():
    """Replicas of three models, two of one vocabulary (the demo target and its 4-bit
    copy): each model's view holds its own only, by vocabulary and by checkpoint name (a
    replica reporting no vocabulary, as older ones, by its name alone); a name given as
    "dir/." is its dir's."""
    from outrider.router.models import ModelIdentity

    from outrider import paths
    dirs = [paths.demo_target_dir(), paths.demo_w4a16_target_dir(),
            paths.demo_cross_draft_dir()]
    models = [ModelIdentity.of(str(d)) for d in dirs]
    vocab = [m.vocab for m in models]
    assert vocab[0] == vocab[1] != vocab[2]
    loads = {f"r{i}:1": pb.Load(target_vocab=vocab[i], model_pair=f"{d.name}+demo-draft",
                                cost=load().cost, gamma_max=8) for i, d in enumerate(dirs)}
    loads["old:1"] = pb.Load(model_pair="demo-target-w4a16", cost=load().cost, gamma_max=8)
    # a replica of another vocabulary named as the first model is not the first model's
    loads["alike:1"] = pb.Load(target_vocab=vocab[2], model_pair="demo-target",
                               cost=load().cost, gamma_max=8)
    replicas = replica_set(loads)
    own = {i: sorted(r.address for r in replicas.live(m.serves))
           for i, m in enumerate(models)}
    assert own == {0: ["r0:1"], 1: ["old:1", "r1:1"], 2: ["r2:1"]}
    chosen = replicas.pick(lambda pair: Acceptance([0.7] * 8), serves=models[2].serves)
    assert chosen.address == "r2:1"
    dotted = ModelIdentity.of(f"{dirs[0]}/.")
    assert [r.address for r in replicas.live(dotted.serves)] == ["r0:1"]


def test_where_replicas_speculate_with_different_drafts_the_request_goes_to_the_better():
    """Two idle replicas of one target, each with its own draft: a request goes to the
    pair whose drafts it is expected to keep more of (the shared statistics for its tag),
    and at equal acceptance to the pair whose drafting costs less."""
    def with_draft(draft: str, draft_s: float = 0.0007) -> pb.Load:
        one = load()
        one.model_pair, one.cost.draft_per_position_s = f"target+{draft}", draft_s
        return one

    replicas = replica_set({"a:1": with_draft("same-family"), "b:1": with_draft("cross")})
    for better in ("same-family", "cross"):
        alphas = lambda pair, better=better: Acceptance([0.9 if better in pair else 0.3] * 8)  # noqa: E731
        chosen = replicas.pick(alphas, prompt_ids=[1, 2, 3], max_tokens=48)
        assert chosen.load.model_pair == f"target+{better}"
    # (the slow one first: a tie would go to the first)
    slow = replica_set({"b:1": with_draft("cross", 0.005), "a:1": with_draft("same-family")})
    chosen = slow.pick(lambda pair: Acceptance([0.7] * 8), prompt_ids=[1, 2, 3], max_tokens=48)
    assert chosen.load.model_pair == "target+same-family"


def test_routing_believes_an_untried_draft_until_its_requests_show_it_stands_aside():
    """A pair with a draft nothing was measured for is believed at PRIOR_ALPHA (so it gets
    requests to learn from) until UNTRIED_REQUESTS of its requests drafted nothing; once
    measured, its statistics; a replica without a draft model, or a request with
    speculation off, is believed to keep nothing."""
    from types import SimpleNamespace

    from outrider.router.auth import Authenticator
    from outrider.router.service import UNTRIED_REQUESTS, GenerationService

    from outrider import paths
    from outrider.core.policy import SpecMode
    from outrider.core.stats import PRIOR_ALPHA, AcceptanceCounts
    from outrider.core.tokenizer import Tokenizer

    store = MemoryStore()
    service = GenerationService(Tokenizer(paths.demo_target_dir()), 2048, store,
                                replica_set({}), Authenticator(store, is_required=False))
    auto = SimpleNamespace(mode=SpecMode.AUTO, stats_tag="code")
    believed = lambda pair, job=auto: service._routing_acceptance(pair, job).alphas  # noqa: E731
    assert believed("target") == [] and believed("target+draft") == [PRIOR_ALPHA]
    assert believed("target+draft", SimpleNamespace(mode=SpecMode.OFF, stats_tag="code")) == []
    service._undrafted[("target+draft", "code")] = UNTRIED_REQUESTS  # (as _record counts)
    assert believed("target+draft") == []
    store.add_acceptance("target+other", "code", AcceptanceCounts([40, 30], [30, 3]))
    assert believed("target+other") == pytest.approx([32.8 / 44, 5.8 / 34])
