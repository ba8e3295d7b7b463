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
        parse_spec(spec_with(proposer="lookahead"))


def test_the_shipped_cpu_spec_loads():
    assert load_spec("deploy/cluster/cpu.yaml").pair.proposer is ProposerKind.AUTO
