"""A draft replica shapes q with the request's processors over the same history as the
target's p, across the wire: a draft with the target's own weights is then always
accepted, greedy or sampled, whatever the penalties, bias, min_tokens or truncation."""

from __future__ import annotations

import pytest

from outrider import paths
from outrider.client import Client
from outrider.local_system import LocalSystemConfig, local_system

pytestmark = pytest.mark.slow

PROCESSORS = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                  min_tokens=20, logit_bias={298: 3.0})


@pytest.fixture(scope="module")
def client():
    target = str(paths.demo_target_dir())
    cfg = LocalSystemConfig(target, target, grpc_port=0, http_port=0)
    with local_system(cfg) as system, Client(system.router) as client:
        yield client


PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n"


def generate(client, speculation: str, **sampling):
    return client.generate(PROMPT, max_tokens=48, speculation=speculation, gamma_max=4,
                           ignore_eos=True, **PROCESSORS, **sampling)


@pytest.mark.parametrize("sampling", [dict(temperature=0),
                                      dict(temperature=0.9, seed=3, top_k=20, min_p=0.05)],
                         ids=["greedy", "sampled"])
def test_a_draft_equal_to_the_target_is_always_accepted(client, sampling):
    g = generate(client, "fixed", **sampling)
    assert g.speculation.draft_tokens > 20
    assert g.speculation.acceptance_rate == 1.0


def test_greedy_with_processors_is_the_same_with_and_without_speculation(client):
    assert generate(client, "fixed", temperature=0).token_ids == \
        generate(client, "off", temperature=0).token_ids
