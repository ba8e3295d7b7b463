"""The `outrider generate --local` contract other work relies on."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outrider import paths
from outrider.launch import free_port
from tests.cli_utils import generate_json, run_cli
from tests.scraping import scrape

PROMPT = "import os\n"


def test_help_lists_subcommands_and_examples():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "generate" in proc.stdout and "examples:" in proc.stdout
    proc = run_cli("generate", "--help")
    for flag in ("--local", "--target", "--draft", "--gamma", "--tp", "--max-tokens",
                 "--temperature", "--top-p", "--top-k", "--seed", "--json"):
        assert flag in proc.stdout


def test_json_output_contract(llama_dir, draft_dir):
    out = generate_json("--target", str(llama_dir), "--draft", str(draft_dir), "--gamma", "3",
                        "--max-tokens", "20", PROMPT)
    assert set(out) >= {"token_ids", "text", "speculation", "finish_reason", "usage", "timings"}
    assert set(out["speculation"]) >= {"draft_tokens", "accepted_tokens", "rounds"}
    assert 1 <= len(out["token_ids"]) <= 20
    assert out["speculation"]["rounds"] >= 1
    assert 0 <= out["speculation"]["accepted_tokens"] <= out["speculation"]["draft_tokens"]
    plain = generate_json("--target", str(llama_dir), "--gamma", "0", "--max-tokens", "20", PROMPT)
    assert plain["token_ids"] == out["token_ids"]
    assert plain["speculation"]["draft_tokens"] == 0


def test_seeded_sampling_is_reproducible(llama_dir, draft_dir):
    args = ("--target", str(llama_dir), "--draft", str(draft_dir), "--temperature", "0.8",
            "--top-p", "0.9", "--top-k", "50", "--seed", "42", "--max-tokens", "24", PROMPT)
    assert generate_json(*args)["token_ids"] == generate_json(*args)["token_ids"]


def test_streamed_text_equals_json_text(llama_dir):
    args = ("--target", str(llama_dir), "--gamma", "0", "--max-tokens", "24")
    streamed = subprocess.run(
        [sys.executable, "-m", "outrider.cli", "generate", "--local", "--stats", *args, "-"],
        input=PROMPT, capture_output=True, text=True, timeout=120)
    assert streamed.returncode == 0, streamed.stderr
    assert "tok/s" in streamed.stderr and "rounds" in streamed.stderr
    assert streamed.stdout.rstrip("\n") == generate_json(*args, PROMPT)["text"].rstrip("\n")


def test_no_router_is_one_clear_line():
    proc = run_cli("generate", "--address", f"127.0.0.1:{free_port()}", PROMPT, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("outrider: error: UNAVAILABLE") and proc.stderr.count("\n") == 1


def test_every_subcommand_has_help():
    from outrider.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) >= {"generate", "serve", "router", "draft-worker", "target-worker",
                             "keys", "status", "demo"}
    for name in commands:
        proc = run_cli(name, "--help", timeout=60)
        assert proc.returncode == 0, (name, proc.stderr)
        assert proc.stdout.startswith(f"usage: outrider {name}") and "--" in proc.stdout


def test_errors_are_one_line_unless_debug(tmp_path):
    proc = run_cli("generate", "--local", "--target", str(tmp_path), PROMPT, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"outrider: error: no model at {tmp_path}")
    debug = run_cli("--debug", "generate", "--local", "--target", str(tmp_path), PROMPT,
                    timeout=60)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_every_flag_has_help_that_shows_its_default(capsys):
    """Read from each subcommand's real `--help`: every option's entry says its default,
    `(default: None)` where it has none, as vLLM's help does (or that it is required)."""
    import argparse

    from outrider.cli import build_parser

    for name in build_parser()._subparsers._group_actions[0].choices:
        parser = build_parser(name)  # as `outrider NAME --help` builds it
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        entries = help_entries(capsys.readouterr().out)
        command = parser._subparsers._group_actions[0].choices[name]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            flag = action.option_strings[0]
            entry = entries.get(flag, "")
            assert action.help and entry, f"outrider {name} {flag}: no help"
            said = "(required)" if action.required else "default"
            assert said in entry, f"outrider {name} {flag}: {entry}"


def help_entries(text: str) -> dict[str, str]:
    """{an option's first flag: its entry in the help, lines joined}."""
    entries, flag = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line.strip()
        elif flag and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_an_enumerated_flag_refuses_a_value_naming_the_choices():
    for flag, value, named in (("--device", "tpu", "auto, cpu, cuda, cuda:N"),
                               ("--dtype", "half", "'bfloat16'"),
                               ("--gpu-memory-utilization", "1.5", "a share in (0, 1]")):
        proc = run_cli("serve", flag, value, timeout=60)
        assert proc.returncode == 2 and named in proc.stderr, proc.stderr


CHAT_TEMPLATE = "<chat>{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_vllm_serve_command_line_works_unchanged(tmp_path, llama_dir, draft_dir):
    """`outrider serve MODEL` with vLLM's flags (two tensor-parallel ranks, the KV cache
    sized from memory on both), then the `openai` package with the key, and the engine's
    metrics where vLLM's are."""
    import openai

    from outrider.client import Client
    from outrider.core.tokenizer import Tokenizer
    from outrider.engine.runner import RunnerConfig

    port = free_port()
    log = tmp_path / "serve.log"
    model = tmp_path / "llama"  # whose generation_config.json makes unset temperatures greedy
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outrider.cli", "serve", str(model),
             "--draft", str(draft_dir),
             "--host", "127.0.0.1", "--port", str(port), "--api-key", "k-1",
             "--served-model-name", "m",
             "--tensor-parallel-size", "2", "--max-num-batched-tokens", "512",
             "--max-model-len", "384", "--chat-template", CHAT_TEMPLATE,
             "--max-num-seqs", "8", "--grpc-port", "0",
             "--tool-call-parser", "hermes"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while f"http://127.0.0.1:{port}/v1" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k-1")
        done = client.completions.create(model="m", prompt=PROMPT, max_tokens=8,
                                          temperature=0)
        assert done.usage.completion_tokens == 8 and done.model == "m"
        # --tensor-parallel-size 2: the target worker runs rank 1 beside its own rank 0
        (target,) = [pid for pid, cmd in descendants(proc.pid).items()
                     if " target-worker " in cmd]
        ranks = [cmd for cmd in descendants(target).values() if "spawn_main" in cmd]
        assert len(ranks) == 1, ranks
        # the KV cache sized from memory (no --kv-cache-mb): on a CPU at most what a full
        # batch of full-length sequences uses, here --max-num-seqs 8 of --max-model-len 384
        router = re.search(r"router listening on (\S+?)[;\s]", log.read_text()).group(1)
        with Client(router, api_key="k-1", timeout_s=60) as sdk:
            (replica,) = sdk.status().replicas
        assert replica.kv_total_blocks == 8 * 384 // RunnerConfig.block_size
        unset = [client.completions.create(model="m", prompt=PROMPT, max_tokens=8, seed=seed)
                 for seed in (1, 2)]  # no temperature: the model's 0.0
        assert [u.choices[0].text for u in unset] == [done.choices[0].text] * 2
        with pytest.raises(openai.BadRequestError, match="384"):  # --max-model-len's
            client.completions.create(model="m", prompt=PROMPT, max_tokens=400)
        chat = client.chat.completions.create(  # rendered by --chat-template
            model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=1)
        tokens = Tokenizer(str(model)).encode(f"<chat>{PROMPT}")
        assert chat.usage.prompt_tokens == len(tokens)
        stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k-2")
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model="m", prompt=PROMPT, max_tokens=1)
        tools_offered_with_no_tool_choice_are_read_from_the_text(client)
        engine = scrape(f"127.0.0.1:{port}")  # the target's vllm:* beside the router's
        generated = {dict(labels)["replica"]: value for (name, labels), value in engine.items()
                     if name == "vllm:generation_tokens_total"}
        (replica, tokens), = generated.items()
        assert tokens >= 8 + 8 + 8 and ":" in replica
        assert engine[("outrider_router_replica_metrics_up", (("replica", replica),))] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below `pid` (from /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # (gone meanwhile)
            continue
        table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)  # its ppid
    found, parents = {}, [pid]
    while parents:
        parent = parents.pop()
        for child, (ppid, cmd) in table.items():
            if ppid == parent:
                found[child] = cmd
                parents.append(child)
    return found


def tools_offered_with_no_tool_choice_are_read_from_the_text(client):
    """What agent frameworks send: tools, no tool_choice. A test model writes no calls of
    its own, so a regex holds it to Hermes' format: the router reads the call from it."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    written = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": ' \
              r'\{"city": "Paris"\}\}\n</tool_call>'
    options = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=[weather], max_tokens=120, temperature=0,
                   extra_body={"structured_outputs": {"regex": written}})
    done = client.chat.completions.create(**options)
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert done.choices[0].message.content == "Checking.\n"
    assert done.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(stream=True, **options))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == "Checking.\n" and [t.function.name for t in streamed] == ["get_weather"]
    assert json.loads(streamed[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_speculative_config_stands_for_draft_gamma_and_proposer(capsys):
    from outrider.target_worker.main import TargetWorkerConfig

    from outrider import paths
    from outrider.cli import build_parser
    from outrider.cli.common import UsageError, model_dirs
    from outrider.cli.roles import _local_system_config

    def parsed(config: dict):
        return build_parser("serve").parse_args(["serve", "--speculative-config",
                                                 json.dumps(config)])

    def serve(config: dict):
        args = parsed(config)
        return model_dirs(args), args

    draft = str(paths.demo_draft_dir())
    (_, got), args = serve({"model": draft, "num_speculative_tokens": 3,
                            "draft_tensor_parallel_size": 1, "use_heterogeneous_vocab": True})
    assert (got, args.gamma, args.proposer) == (draft, 3, "model")
    (_, got), args = serve({"method": "ngram", "num_speculative_tokens": 5})
    assert (got, args.gamma, args.proposer) == (None, 5, "ngram")
    assert _local_system_config(parsed({"method": "ngram"})).ngram_sizes == (2, 5)
    _, args = serve({"method": "ngram", "prompt_lookup_max": 4})  # (vLLM's would be 4, 4)
    assert args.ngram_sizes == (2, 4)
    config = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert _local_system_config(parsed(config)).ngram_sizes == (1, 3)
    twice = build_parser("serve").parse_args(["serve", "--ngram-sizes", "2,3",
                                              "--speculative-config", json.dumps(config)])
    with pytest.raises(UsageError, match="say what --ngram-sizes says"):
        model_dirs(twice)
    worker = build_parser("target-worker").parse_args(["target-worker", "--model", draft,
                                                       "--ngram-sizes", "1,3"])
    assert TargetWorkerConfig.from_args(worker).ngram_sizes == (1, 3)
    head = str(paths.demo_head_dir())
    (_, got), args = serve({"method": "eagle3", "model": head, "num_speculative_tokens": 5})
    assert (got, args.gamma, args.proposer) == (head, 5, "model")
    for config, says in (({"method": "eagle3"}, "needs a model"),
                         ({"method": "medusa", "model": head}, "holds no medusa head"),
                         ({"method": "mtp"}, "choose from"),
                         ({"method": "eagle3", "model": draft}, "holds no eagle3 head"),
                         ({"method": "eagle", "model": head}, "holds no eagle1 head"),
                         ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                          "1 <= min <= max"),
                         ({"model": draft, "prompt_lookup_max": 3}, "not taken"),
                         ({"model": draft, "draft_tensor_parallel_size": 2}, "run whole")):
        with pytest.raises(SystemExit) as stop:
            serve(config)
        assert stop.value.code == 2 and says in capsys.readouterr().err, config


@pytest.mark.slow
def test_serve_puts_an_eagle_head_on_draft_replicas_when_asked():
    """`outrider serve --draft HEAD --head-on-replicas`: the head drafts on the draft
    replicas (they load the target's embedding): its rounds are counted as eagle3 and a
    draft replica answers the Proposes; a draft model, or trees, refused by name."""
    from outrider import paths
    from outrider.cli import build_parser
    from outrider.cli.roles import _local_system_config
    from outrider.client import Client
    from outrider.local_system import local_system
    from tests.scraping import total

    def config(*argv: str):
        return _local_system_config(build_parser("serve").parse_args(["serve", *argv]))

    head = str(paths.demo_head_dir())
    cfg = config("--draft", head, "--head-on-replicas", "--draft-replicas", "2")
    assert (cfg.draft, cfg.head_on_replicas, cfg.draft_replicas) == (head, True, 2)
    with pytest.raises(ValueError, match="needs an EAGLE-3 or EAGLE-1 head"):
        config("--draft", str(paths.demo_draft_dir()), "--head-on-replicas")
    with pytest.raises(ValueError, match="in the target's process"):
        config("--draft", head, "--head-on-replicas", "--tree-topk", "3", "--tree-tokens",
               "8")
    # started as `serve` starts it (one draft replica: what the flag does, at less cost;
    # the head alone proposes, so every drafted token is its)
    cfg = config("--draft", head, "--head-on-replicas", "--grpc-port", "0", "--no-http",
                 "--kv-cache-mb", "16", "--proposer", "model")
    with local_system(cfg) as system:
        drafted = lambda: total(scrape(system.metrics["draft-0"]),  # noqa: E731
                                "outrider_draft_proposals_total")
        before = drafted()
        with Client(system.router, timeout_s=120) as client:
            done = client.generate(PROMPT, max_tokens=16, temperature=0.0,
                                   speculation="fixed", gamma_max=4)
        spec = done.speculation
        assert spec.by_proposer == {"eagle3": (spec.draft_tokens, spec.accepted_tokens)}
        drafting_rounds = spec.drafted_per_position[0]
        assert drafting_rounds > 0, spec
        assert drafted() >= before + drafting_rounds  # each drafted on the replica
        rounds = total(scrape(system.metrics["target"]), "vllm:spec_decode_num_drafts_total",
                       method="eagle3")
        assert rounds >= drafting_rounds


def test_quantization_names_the_checkpoints_method_as_vllm_takes_it(tmp_path):
    """vLLM's --quantization, checked against the checkpoint's quantization_config: its own
    method (or the method's Marlin name) serves; another is a usage error naming what the
    checkpoint says; an unquantized checkpoint takes fp8 (quantized as it loads) and no
    other."""
    from outrider.cli import build_parser
    from outrider.cli.common import UsageError, model_dirs

    def check(*argv):
        return model_dirs(build_parser("serve").parse_args(["serve", *argv]))

    w4a16 = str(paths.demo_w4a16_target_dir())
    assert check(w4a16, "-q", "compressed-tensors")[0] == Path(w4a16)
    awq = tmp_path / "awq"
    awq.mkdir()
    (awq / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    assert check(str(awq), "--quantization", "awq_marlin", "--draft", "")[0] == awq
    with pytest.raises(UsageError, match="quant_method 'compressed-tensors'"):
        check(w4a16, "--quantization", "awq")
    assert check("--quantization", "fp8")[0] == paths.demo_target_dir()  # bf16, on load
    with pytest.raises(UsageError, match="is not quantized, and only fp8"):
        check("--quantization", "gptq")
    with pytest.raises(SystemExit):  # argparse names the choices
        check(w4a16, "--quantization", "bitsandbytes")
