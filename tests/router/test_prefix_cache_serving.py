"""Prefix caching served: one router in front of two target replicas (and a draft) on the
shipped demo pair. Conversations find their earlier turns cached and stay on one replica;
cached tokens reach the OpenAI usage, the SDK and the metrics; outputs with a warm cache
equal those with a cold one."""

from __future__ import annotations

import urllib.request

import pytest
from tokenizers import Tokenizer

from outrider import paths
from outrider.client import Client
from outrider.local_system import LocalSystemConfig, local_system
from tests.router.demo_system import openai_client
from tests.scraping import scrape

pytestmark = pytest.mark.slow

KEY = "or-prefix-test-key"
TOKENIZER = Tokenizer.from_file(str(paths.demo_target_dir() / "tokenizer.json"))
GREEDY = dict(max_tokens=16, temperature=0.0, ignore_eos=True)


def system_prompt(name: str) -> str:
    """About 300 tokens no other test sends: its blocks are cold at first."""
    return "".join(f"# {name}: rule {i} is to check the value of x_{i} before use\n"
                   for i in range(24))


@pytest.fixture(scope="module")
def system():
    cfg = LocalSystemConfig(str(paths.demo_target_dir()), str(paths.demo_draft_dir()),
                            grpc_port=0, http_port=0, target_replicas=2, metrics=True)
    with local_system(cfg, env={"OUTRIDER_API_KEYS": KEY}) as running:
        yield running


@pytest.fixture(scope="module")
def client(system):
    with Client(system.router, api_key=KEY, timeout_s=120) as c:
        yield c


def test_a_conversation_finds_its_turns_cached_on_one_replica(client):
    history = system_prompt("conversation")
    replicas, cached = [], []
    for turn in range(4):
        history += f"\n# user turn {turn}: write the next function\ndef step_{turn}("
        result = client.generate(history, **GREEDY)
        replicas.append(result.replica)
        cached.append(result.usage.cached_prompt_tokens)
        assert result.usage.cached_prompt_tokens <= result.usage.prompt_tokens
        history += result.text
    assert cached[0] == 0
    earlier = len(TOKENIZER.encode(system_prompt("conversation")).ids)
    assert all(c >= earlier - 16 for c in cached[1:]), cached  # the block-aligned prefix
    assert cached[3] > cached[1]  # the answers and turns before are cached too
    assert len(set(replicas)) == 1, replicas


def test_warm_and_cold_caches_give_the_same_tokens(client):
    prompt = system_prompt("same-tokens") + "def check(values):\n"
    cold = client.generate(prompt, **GREEDY, logprobs=2)
    warm = client.generate(prompt, **GREEDY, logprobs=2)
    assert cold.usage.cached_prompt_tokens == 0 < warm.usage.cached_prompt_tokens
    assert warm.token_ids == cold.token_ids
    # one token changed in the middle: only the blocks before it can be shared
    ids = TOKENIZER.encode(prompt).ids
    middle = len(ids) // 2
    changed = ids[:middle] + [ids[middle] + 1] + ids[middle + 1:]
    other = client.generate(changed, **GREEDY)
    assert 0 < other.usage.cached_prompt_tokens <= middle


def test_cached_tokens_reach_the_openai_usage_and_the_metrics(system):
    oai = openai_client(system, KEY)
    prompt = system_prompt("openai") + "def main():\n"
    usages = [oai.completions.create(model="demo-target", prompt=prompt, **{
        k: v for k, v in GREEDY.items() if k != "ignore_eos"}).usage for _ in range(2)]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens >= usages[1].prompt_tokens - 16
    stream = oai.chat.completions.create(
        model="demo-target", messages=[{"role": "system", "content": system_prompt("chat")},
                                       {"role": "user", "content": "hello"}],
        stream=True, stream_options={"include_usage": True}, max_tokens=4)
    assert [c.usage for c in stream if c.usage][0].prompt_tokens_details.cached_tokens >= 0
    hits = queries = 0.0
    for name in ("target", "target-1"):
        text = urllib.request.urlopen(f"http://{system.metrics[name]}/metrics",
                                      timeout=10).read().decode()
        hits += metric(text, "vllm:prefix_cache_hits_total")
        queries += metric(text, "vllm:prefix_cache_queries_total")
    assert 0 < hits < queries
    # the router's /metrics serves both replicas' families, a series each, a name once
    routed = [(dict(labels)["replica"], value) for (name, labels), value
              in scrape(system.http).items() if name == "vllm:prefix_cache_hits_total"]
    assert len({replica for replica, _ in routed}) == 2 and sum(v for _, v in routed) == hits
    page = urllib.request.urlopen(f"http://{system.http}/metrics", timeout=10).read().decode()
    types = [line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    # its --metrics-port, scraped beside the replicas' in a cluster, holds its own alone
    assert not any("replica" in dict(labels) for _, labels in scrape(system.metrics["router"]))
    draft = urllib.request.urlopen(f"http://{system.metrics['draft-0']}/metrics",
                                   timeout=10).read().decode()
    assert metric(draft, "outrider_draft_prefix_cache_hits_total") > 0


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))
