"""The γ policy's special rounds as the target replica's engine runs them (docs/DESIGN.md
§4.4): while the draft model does not pay, an AUTO request's rounds look up alone, and
every PROBE_AFTER steps one round drafts a single token with the model, which no lookup
may stand in for."""

from __future__ import annotations

from typing import NamedTuple

from outrider.target_worker.engine import Handle, TargetEngine
from outrider.target_worker.scheduler import SchedulerConfig

from outrider.core.policy import (
    PROBE_AFTER,
    Acceptance,
    CostModel,
    GammaPolicy,
    PolicyConfig,
    RequestState,
    SpecMode,
)
from outrider.core.sampling import SamplingParams
from outrider.core.sequence import Round
from outrider.engine.drafter import Drafter
from outrider.engine.mix import ProposerMix
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import SpeculativeDecoder

# the model's drafting costs a second a position: the policy never chooses it
SLOW_DRAFT = CostModel(verify_base_s=0.005, verify_per_token_s=0.0001,
                       draft_per_position_s=1.0)
PROMPT = [11, 12, 13, 14, 15, 16, 17]
MAX_TOKENS = 400  # more than lookups of γ_max tokens take in PROBE_AFTER steps


class Step(NamedTuple):
    probed: bool      # the policy's choice for the request this step
    looked_up: bool
    round: Round      # what the request's round did
    model_gammas: list[int]  # γ of each item the draft model was asked for


def test_the_probe_drafts_with_the_model_and_the_rounds_between_look_up(llama_dir, draft_dir):
    target = ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=32))
    model = Drafter(ModelRunner(RunnerConfig(str(draft_dir), kv_cache_mb=16)))
    asked: list[int] = []
    submit = model.submit

    def counted(items, *args, **kwargs):
        asked.extend(item.gamma for item in items)
        return submit(items, *args, **kwargs)
    model.submit = counted
    mix = ProposerMix(model, target.vocab_size)
    decoder = SpeculativeDecoder(target, mix)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    served = decoder.generate([PROMPT], params, gamma=0)[0]
    mix.corpus.add(PROMPT + served.output_ids)  # served before: the suffix lookup finds it
    engine = TargetEngine(decoder, SchedulerConfig(), GammaPolicy(PolicyConfig(), SLOW_DRAFT))
    seq = decoder.new_sequence(PROMPT, params)
    spec = RequestState(Acceptance([0.9] * 8), SpecMode.AUTO, looks_up=True)
    engine.submit(Handle("r", seq, spec, gamma_limit=8))
    engine._admit_new()
    steps = []
    while not any(s.probed for s in steps) and len(steps) < 3 * PROBE_AFTER:
        asked.clear()
        # the step untimed: on a loaded machine one stalled 9-token step fitted a verify
        # slope that made γ 0 the better choice (the cost model's own tests cover that)
        assert engine._step()
        steps.append(Step(engine.policy.probed == [0], engine.policy.looked_up == [0],
                          seq.last_round, list(asked)))
    probes = [s for s in steps if s.probed]
    lookups = [s for s in steps[1:] if s.looked_up]  # after the prompt's step
    assert len(probes) == 1 and len(steps) <= PROBE_AFTER + 1, steps
    assert probes[0].round.gamma == 1 and probes[0].round.num_free == 0, probes
    assert probes[0].model_gammas == [1], probes  # the model drafted the probe's token
    assert len(lookups) >= PROBE_AFTER // 2, steps
    assert all(s.model_gammas == [] for s in lookups), lookups  # the model was not asked
    assert all(s.round.num_free == s.round.gamma > 0 for s in lookups), lookups
    assert {s.round.free_kind for s in lookups} == {"suffix"}
    assert seq.output_ids == served.output_ids[:len(seq.output_ids)]
    decoder.release(seq)


def test_the_replica_learns_acceptance_per_class(llama_dir):
    """Greedy requests, sampled ones at each temperature (to a tenth) and constrained ones
    start from estimates of their own (docs/DESIGN.md §4.1): what a greedy round taught
    does not reach a sampled request's start."""
    decoder = SpeculativeDecoder(ModelRunner(RunnerConfig(str(llama_dir), kv_cache_mb=8)))
    engine = TargetEngine(decoder, SchedulerConfig(), GammaPolicy(PolicyConfig(), SLOW_DRAFT))
    greedy, warm = SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)
    engine.acceptance_for(greedy).update(4, 4)
    assert engine.acceptance_for(greedy).alphas[0] > 0.7
    assert engine.acceptance_for(warm).alphas == [0.7] * PolicyConfig().gamma_max
    assert engine.acceptance_for(SamplingParams(temperature=0.66)) is engine.acceptance_for(warm)
    assert engine.acceptance_for(SamplingParams(temperature=1.0)) is not engine.acceptance_for(warm)


def test_newcomers_do_not_warm_the_draft_while_auto_speculates_for_no_one():
    """An AUTO newcomer's γ at its prefill step has the draft take in its prompt, which the
    step waits for: not where every AUTO request already decoding is at γ 0; where one
    speculates, or none decodes yet (one stream), or for a FIXED newcomer, it stays."""
    from types import SimpleNamespace

    from outrider.target_worker.engine import _no_warming_while_off

    def case(outputs, modes, gammas):
        seqs = [SimpleNamespace(num_output=n) for n in outputs]
        states = [RequestState(Acceptance([0.9]), mode) for mode in modes]
        _no_warming_while_off(seqs, states, gammas)
        return gammas

    auto, fixed = SpecMode.AUTO, SpecMode.FIXED
    assert case([5, 9, 0, 0], [auto, auto, auto, fixed], [0, 0, 3, 2]) == [0, 0, 0, 2]
    assert case([5, 9, 0], [auto, auto, auto], [0, 1, 3]) == [0, 1, 3]
    assert case([0], [auto], [4]) == [4]
