"""Cluster specs (outrider.cluster.spec): the proposer a pair's target replicas use."""

from __future__ import annotations

import pytest
from outrider.cluster.spec import SpecError, load_spec, parse_spec

from outrider.core.sequence import ProposerKind


def spec_with(**pair) -> dict:
    return {"redis_url": "redis://127.0.0.1:6379/0",
            "models": [{"name": "demo", "target": "models/demo-target", "drafts_per_target": 0,
                        **pair}]}


def test_a_pair_names_its_proposer_and_auto_is_the_default():
    assert parse_spec(spec_with()).pair.proposer is ProposerKind.AUTO
    assert parse_spec(spec_with(proposer="suffix")).pair.proposer is ProposerKind.SUFFIX
    with pytest.raises(SpecError, match=r"models\.0\.proposer"):
        parse_spec(spec_with(proposer="bigram"))


def test_the_shipped_cpu_spec_loads():
    assert load_spec("deploy/cluster/cpu.yaml").pair.proposer is ProposerKind.AUTO


def test_an_eagle_head_drafts_on_the_replicas_and_medusa_is_refused(tmp_path, llama_dir):
    from outrider.paths import models_dir
    from tests.checkpoints import save_random_medusa

    head = parse_spec(spec_with(draft=str(models_dir() / "demo-eagle3"),
                                drafts_per_target=1)).pair
    assert head.draft_is_head  # the replicas get the target's dir, the target the head's
    model = parse_spec(spec_with(draft=str(models_dir() / "demo-draft"), drafts_per_target=1))
    assert not model.pair.draft_is_head
    medusa = save_random_medusa(tmp_path / "medusa", llama_dir)
    with pytest.raises(SpecError, match="Medusa heads draft in the target's process"):
        parse_spec(spec_with(draft=str(medusa), drafts_per_target=1))


def test_a_pair_with_no_draft_may_draft_with_its_targets_own_layers():
    assert parse_spec(spec_with(self_draft_layers="auto")).pair.self_draft_layers == "auto"
    assert parse_spec(spec_with(self_draft_layers="0,3")).pair.self_draft_layers == "0,3"
    for bad, why in [(dict(self_draft_layers="first"), r"models\.0\.self_draft_layers"),
                     (dict(self_draft_layers="auto", draft="models/demo-draft",
                           drafts_per_target=1), "give no draft"),
                     (dict(self_draft_layers="auto", tp=2), "needs tp 1")]:
        with pytest.raises(SpecError, match=why):
            parse_spec(spec_with(**bad))


def test_cache_aware_sampling_is_a_share_and_needs_the_cache():
    pair = parse_spec(spec_with(speculation_cache=True, cache_aware_sampling=0.5)).pair
    assert (pair.speculation_cache, pair.cache_aware_sampling) == (True, 0.5)
    for bad, why in [(dict(speculation_cache=True, cache_aware_sampling=0), "greater than 0"),
                     (dict(speculation_cache=True, cache_aware_sampling=1.5), "less than or equal"),
                     (dict(cache_aware_sampling=0.5), "needs speculation_cache: true")]:
        with pytest.raises(SpecError, match=why):
            parse_spec(spec_with(**bad))


def test_several_pairs_each_named_and_counted():
    """A spec may list several pairs (one router serves every pair's target); each needs a
    name and a target dir name of its own; Ray is asked for every pair's cores."""
    from pathlib import Path

    from outrider.cluster.launch import required_cpus, with_absolute_paths

    second = {"name": "cross", "target": "models/demo-draft-bpe2k", "drafts_per_target": 0}
    spec = parse_spec({**spec_with(), "models": [*spec_with()["models"], second]})
    assert [p.name for p in spec.models] == ["demo", "cross"] and spec.pair.name == "demo"
    alone = parse_spec(spec_with())
    assert required_cpus(spec) == required_cpus(alone) + 1  # the second target's core
    assert all(Path(p.target).is_absolute()
               for p in with_absolute_paths(spec, Path.cwd()).models)
    for clash, what in (({"name": "demo"}, "a name"),
                        ({"target": "other/demo-target"}, r"a target dir's name \(or")):
        with pytest.raises(SpecError, match=f"models: each pair needs {what}"):
            parse_spec({**spec_with(), "models": [*spec_with()["models"], {**second, **clash}]})
    # a second draft for the same target: one model, two pairs (but not two of one name)
    again = {**second, "target": "models/demo-target", "draft": "models/demo-draft",
             "drafts_per_target": 1}
    assert len(parse_spec({**spec_with(), "models": [*spec_with()["models"], again]}).models) == 2
    with pytest.raises(SpecError, match=r"a draft dir's name \(among pairs of one target"):
        parse_spec({**spec_with(), "models": [*spec_with()["models"], again,
                                              {**again, "name": "third", "draft": "x/demo-draft"}]})
