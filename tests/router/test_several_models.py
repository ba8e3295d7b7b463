"""One router, two targets of two tokenizers, one draft replica drafting for both
(`outrider serve TARGET --also-serve OTHER`, docs/DESIGN.md §9.2)."""

from __future__ import annotations

import grpc
import openai
import pytest
from outrider.router.models import ModelIdentity

from outrider import paths
from outrider.client import Client
from outrider.client.errors import NotFoundError
from outrider.core.tokenizer import Tokenizer, vocab_fingerprint
from outrider.grpc_server import token_metadata
from outrider.local_system import LocalSystemConfig, local_system
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

PROMPTS = ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n")
TOKENS = 24
TOKEN = "several-models"  # the workers' cluster token


@pytest.mark.slow
def test_one_router_serves_two_targets_of_two_tokenizers_from_one_draft_replica():
    """The demo target and a checkpoint of its own 2,048-token BPE (the shipped
    demo-draft-bpe2k, served as a target here), behind one router, both speculating with
    one replica of the demo draft (its own vocabulary for the first, through text for the
    second). Each model's greedy output, by HTTP and by the SDK, is its own with
    speculation off, each counted under its own method; the router lists both; a request
    naming no model gets the first; an unknown model is NOT_FOUND naming those served."""
    first, other = paths.demo_target_dir(), paths.demo_cross_draft_dir()
    assert Tokenizer(first).vocab_size != Tokenizer(other).vocab_size
    cfg = LocalSystemConfig(str(first), str(paths.demo_draft_dir()), grpc_port=0,
                            http_port=0, also_serve=(str(other),))
    with local_system(cfg, TOKEN) as system:
        assert len(system.drafts) == 1 and len(system.targets) == 2
        oai = openai.OpenAI(base_url=f"http://{system.http}/v1", api_key="-", max_retries=0,
                            timeout=120)
        names = [m.id for m in oai.models.list().data]
        assert names == [first.name, other.name]
        methods = {}
        with Client(system.router, timeout_s=120) as client:
            for name in names:
                for prompt in PROMPTS:
                    plain, spec = (oai.completions.create(
                        model=name, prompt=prompt, max_tokens=TOKENS, temperature=0.0,
                        extra_body={"ignore_eos": True, "speculation": mode, "gamma": 3,
                                    "proposer": "model"})
                        for mode in ("off", "fixed"))
                    assert spec.choices[0].text == plain.choices[0].text, (name, prompt)
                    by_sdk = client.generate(prompt, max_tokens=TOKENS, temperature=0.0,
                                             ignore_eos=True, model=name)
                    assert by_sdk.text == plain.choices[0].text
                    usage = spec.usage.model_extra["speculation"]
                    methods.setdefault(name, set()).update(usage["by_proposer"])
            default = client.generate(PROMPTS[0], max_tokens=TOKENS, temperature=0.0,
                                      ignore_eos=True)
            assert default.text == client.generate(
                PROMPTS[0], max_tokens=TOKENS, temperature=0.0, ignore_eos=True,
                model=first.name).text
            with pytest.raises(NotFoundError, match="'nope' does not exist.*demo-draft-bpe2k"):
                client.generate(PROMPTS[0], max_tokens=4, model="nope")
        assert methods == {first.name: {"draft_model"}, other.name: {"cross_vocab"}}, methods
        with pytest.raises(openai.NotFoundError, match="demo-target"):
            oai.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=4)
        # each replica says its vocabulary, and only its own model's identity accepts it
        identities = [ModelIdentity.of(str(d)) for d in (first, other)]
        for address, own in zip(system.targets, identities):
            with grpc.insecure_channel(address) as channel:
                load = worker_pb2_grpc.TargetStub(channel).GetLoad(
                    pb.LoadRequest(), metadata=token_metadata(TOKEN), timeout=10)
            assert load.target_vocab == own.vocab == vocab_fingerprint(
                first if own is identities[0] else other)
            assert [i.serves(load) for i in identities] == [i is own for i in identities]


def test_serve_refuses_targets_it_could_not_tell_apart_or_draft_for():
    """Refused at start, naming why: two targets of one dir name (a request names its model
    by it); a head shared among targets; the speculation cache or --adapt with a target of
    another vocabulary (both work in the draft's ids)."""
    target, draft = str(paths.demo_target_dir()), str(paths.demo_draft_dir())
    other = str(paths.demo_cross_draft_dir())
    with pytest.raises(ValueError, match="targets' dirs must have distinct names"):
        LocalSystemConfig(target, draft, also_serve=(target,))
    with pytest.raises(ValueError, match="a head or --self-draft-layers belongs to one"):
        LocalSystemConfig(target, str(paths.demo_head_dir()), also_serve=(other,))
    for flag in ({"speculation_cache": True}, {"adapt": True}):
        for more in ({"also_serve": (other,)}, {"also_draft": (other,)}):
            with pytest.raises(ValueError, match="another vocabulary .* --speculation-cache"):
                LocalSystemConfig(target, draft, **more, **flag)
    with pytest.raises(ValueError, match="draft models' dirs must have distinct names"):
        LocalSystemConfig(target, draft, also_draft=(draft,))
    with pytest.raises(ValueError, match="--also-draft: another draft model beside"):
        LocalSystemConfig(target, None, also_draft=(other,))
    # (through text: served) a target replica per draft model, one per other target
    both = LocalSystemConfig(target, draft, also_serve=(other,), also_draft=(other,),
                             target_replicas=2)
    assert both.drafts == [draft, other] and both.num_target_replicas == 5
