"""GenerateRequest messages from keyword options."""

from __future__ import annotations

import json

from outrider.v1 import generate_pb2 as gp

MODES = {"auto": gp.SPECULATION_MODE_AUTO, "off": gp.SPECULATION_MODE_OFF,
         "fixed": gp.SPECULATION_MODE_FIXED}


def build_request(prompt: str | list[int], *, max_tokens: int | None = None,
                  temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None,
                  stop: list[str] = (), stop_token_ids: list[int] = (),
                  ignore_eos: bool = False, speculation: str = "auto", gamma_max: int = 0,
                  request_id: str = "", tag: str = "", include_rounds: bool = False,
                  min_p: float | None = None, repetition_penalty: float | None = None,
                  frequency_penalty: float | None = None, presence_penalty: float | None = None,
                  logit_bias: dict[int, float] | None = None, min_tokens: int = 0,
                  logprobs: int | None = None, proposer: str = "",
                  tree_topk: int = 0, tree_tokens: int = 0,
                  json_schema: dict | bool | str | None = None, json_object: bool = False,
                  regex: str | None = None, choice: list[str] | None = None,
                  grammar: str | None = None,
                  whitespace_flexible: bool = False, include_stop_str_in_output: bool = False,
                  skip_special_tokens: bool = True, model: str = "") -> gp.GenerateRequest:
    """A GenerateRequest; options left None take the router's defaults (16 tokens,
    temperature 1, no top-k/top-p/min-p, no penalties, a random seed, no logprobs).
    logprobs=k returns each token's log-probability and its k likeliest alternatives.
    proposer: "auto", "model", "ngram", "suffix" or "lookahead" ("": the replica's choice).
    tree_topk, tree_tokens: this request's token tree within the replica's (tree_topk 1:
    chains; 0: the replica's shape).
    At most one constraint on the output (docs/API.md "Structured outputs"): json_schema
    (a dict or JSON text), json_object, regex, choice (the output is one of the strings)
    or grammar (Lark or GBNF); whitespace_flexible lets JSON hold any whitespace.
    The text: include_stop_str_in_output keeps the stop string that ends it;
    skip_special_tokens=False shows special tokens (vLLM's meanings).
    model: the served model's id, of a router serving several ("": its first)."""
    if speculation not in MODES:
        raise ValueError(f"speculation must be one of {sorted(MODES)}, got {speculation!r}")
    sampling = gp.SamplingOptions(stop=list(stop), ignore_eos=ignore_eos,
                                  include_stop_str_in_output=include_stop_str_in_output,
                                  keep_special_tokens=not skip_special_tokens)
    _set_ids(sampling.stop_token_ids, stop_token_ids, "stop_token_ids")
    try:
        sampling.logit_bias.update(logit_bias or {})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"logit_bias: {exc}") from None
    for name, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens),
                        ("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                        ("seed", seed), ("min_p", min_p),
                        ("repetition_penalty", repetition_penalty),
                        ("frequency_penalty", frequency_penalty),
                        ("presence_penalty", presence_penalty), ("logprobs", logprobs)):
        if value is not None:
            try:
                setattr(sampling, name, value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}: {exc}") from None
    constraint = structured_output(json_schema=json_schema, json_object=json_object, regex=regex,
                                   choice=choice, grammar=grammar,
                                   whitespace_flexible=whitespace_flexible)
    if constraint is not None:
        sampling.structured_output.CopyFrom(constraint)
    req = gp.GenerateRequest(sampling=sampling, request_id=request_id, tag=tag,
                             include_rounds=include_rounds, proposer=proposer, model=model,
                             speculation=gp.SpeculationOptions(
                                 mode=MODES[speculation], gamma_max=gamma_max,
                                 tree_topk=tree_topk, tree_tokens=tree_tokens))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        _set_ids(req.token_ids.ids, prompt, "prompt")
    return req


def structured_output(*, json_schema: dict | bool | str | None = None, json_object: bool = False,
                      regex: str | None = None, choice: list[str] | None = None,
                      grammar: str | None = None,
                      whitespace_flexible: bool = False) -> gp.StructuredOutput | None:
    """The one constraint given (None: none); more than one is a ValueError."""
    given = {name: value for name, value in (
        ("json_schema", json_schema), ("json_object", json_object or None), ("regex", regex),
        ("choice", choice), ("grammar", grammar)) if value is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one output constraint, not {' and '.join(given)}")
    if not given:
        return None
    (kind, value), = given.items()
    msg = gp.StructuredOutput(whitespace_flexible=whitespace_flexible)
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    try:
        if kind == "choice":
            msg.choice.choices.extend(value)
        else:
            setattr(msg, kind, value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{kind}: {exc}") from None
    return msg


def _set_ids(field, ids, name: str) -> None:
    try:
        field.extend(ids)
    except (TypeError, ValueError) as exc:  # e.g. beyond int32
        raise ValueError(f"{name}: {exc}") from None
