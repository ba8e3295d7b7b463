"""Each kind of bad input gets one clear error that names the problem."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from outrider import paths
from outrider.core.sampling import SamplingParams
from outrider.core.structured import StructuredOutput
from outrider.engine.checkpoint import CheckpointError
from outrider.engine.cross_vocab import pair_bridge
from outrider.engine.drafter import Drafter
from outrider.engine.memory import ram_bytes
from outrider.engine.model_config import ModelConfigError
from outrider.engine.runner import ModelRunner, RunnerConfig
from outrider.engine.spec_decode import RequestError, SpeculativeDecoder
from tests.checkpoints import edit_config, save_random_checkpoint
from tests.cli_utils import run_cli


@pytest.fixture
def model_copy(tmp_path, llama_dir):
    return shutil.copytree(llama_dir, tmp_path / "model")


def load(model_dir, **kwargs):
    return ModelRunner(RunnerConfig(str(model_dir), **kwargs))


def test_unknown_architecture(model_copy):
    edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load(model_copy)


@pytest.mark.parametrize("quantization, named", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 2, "type": "int", "group_size": 128, "symmetric": True}}}},
     "compressed-tensors, 2-bit int weights, group size 128, format pack-quantized"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "awq, 4-bit int weights, group size 128, format gemv"),
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"},
     "fp8, e5m2 weights, dynamic activations"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes")])
def test_a_quantized_checkpoint_is_refused_by_its_scheme(model_copy, quantization, named):
    """Not a packed tensor's name the model does not know: the checkpoint's scheme."""
    edit_config(model_copy, quantization_config=quantization)
    with pytest.raises(ModelConfigError, match=f"a quantized checkpoint that cannot be "
                                               f"served: {named}"):
        load(model_copy)


def test_missing_config(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load(tmp_path)


def test_config_missing_key_and_bad_json(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="missing required key 'hidden_size'"):
        load(model_copy)
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load(model_copy)


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights found"):
        load(model_copy)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weights(model_copy, damage):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 4096)
    with pytest.raises(CheckpointError, match="corrupt or unreadable safetensors"):
        load(model_copy)


def test_missing_tensor(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    model_dir = shutil.copytree(llama_dir, tmp_path / "m")
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks tensors .*layers.1.mlp.gate_up_proj"):
        load(model_dir)


def test_wrong_tensor_shape(model_copy):
    edit_config(model_copy, intermediate_size=96)
    pattern = r"mlp\.\w+_proj\.weight.*has shape \(\d+, \d+\), the config implies"
    with pytest.raises(CheckpointError, match=pattern):
        load(model_copy)


def test_missing_shard(tmp_path):
    model_dir = save_random_checkpoint(tmp_path, "qwen2", max_shard_size="60KB")
    next(model_dir.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard.*missing"):
        load(model_dir)


def test_draft_with_different_vocabulary(tmp_path, llama_dir, tokenizer_dir):
    """A draft of another size proposes through text (cross_vocab.py) when it has a
    tokenizer.json; without one it cannot, and is refused saying why."""
    other = save_random_checkpoint(tmp_path / "other", vocab_size=400,
                                   tokenizer_from=tokenizer_dir)
    assert pair_bridge(str(llama_dir), str(other)) is not None
    (other / "tokenizer.json").unlink()
    with pytest.raises(RequestError, match="different vocabularies: 400 vs 320 tokens, and "
                                           "the draft has no tokenizer.json"):
        pair_bridge(str(llama_dir), str(other))
    with pytest.raises(RequestError, match="different vocabularies"):
        SpeculativeDecoder(load(llama_dir), Drafter(load(other)))


def test_draft_with_different_tokenizer(model_copy, llama_dir):
    """Two ids swapped: the same tokens under other ids, bridged id for id."""
    tok = json.loads((model_copy / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (model_copy / "tokenizer.json").write_text(json.dumps(tok))
    bridge = pair_bridge(str(llama_dir), str(model_copy))
    assert bridge.shared[10] == 11 and bridge.shared[11] == 10 and bridge.shared[12] == 12


@pytest.mark.parametrize("bad", [{"tp": 3}, {"device": "tpu"}, {"kv_cache_mb": 0},
                                 {"dtype": "int8"}])
def test_bad_runner_settings(llama_dir, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        load(llama_dir, **bad)


@pytest.mark.parametrize("prompt,message", [([], "prompt is empty"),
                                            ([5, 320], "token id 320 is outside"),
                                            ([5] * 600, "prompt has 600 tokens")])
def test_bad_prompts(llama_dir, prompt, message):
    with pytest.raises(RequestError, match=message):
        SpeculativeDecoder(load(llama_dir)).new_sequence(prompt, SamplingParams())


@pytest.mark.parametrize("flag,value,field", [
    ("--temperature", "nan", "temperature"), ("--temperature", "-1", "temperature"),
    ("--top-p", "1.5", "top_p"), ("--top-p", "0", "top_p"), ("--top-k", "-2", "top_k"),
    ("--max-tokens", "0", "max_tokens"), ("--gamma", "-1", "gamma"), ("--tp", "3", "tp=3"),
])
def test_cli_reports_one_readable_line(llama_dir, flag, value, field):
    proc = run_cli("generate", "--local", "--target", str(llama_dir), flag, value, "hello")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outrider: error:"), proc.stderr
    assert field in lines[0]


def test_cli_missing_model_dir(tmp_path):
    proc = run_cli("generate", "--local", "--target", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 1 and "no model at" in proc.stderr


def test_prompt_larger_than_the_kv_cache_is_refused(llama_dir):
    runner = load(llama_dir, block_size=4, kv_cache_mb=0.05)  # 100 positions
    decoder = SpeculativeDecoder(runner)
    assert decoder.max_model_len == 100
    with pytest.raises(RequestError, match="context is 100"):
        decoder.new_sequence([5] * 100, SamplingParams())


@pytest.mark.parametrize("resume,params", [([5, 6, 7], SamplingParams(max_tokens=3)),
                                           ([5, 2], SamplingParams(max_tokens=9)),
                                           ([5, 9], SamplingParams(stop_token_ids=(9,)))])
def test_resumed_tokens_that_already_finish_are_refused(llama_dir, resume, params):
    with pytest.raises(RequestError, match="already finish"):
        SpeculativeDecoder(load(llama_dir)).new_sequence([1, 2, 3], params, resume)


def test_tiny_temperature_is_greedy(llama_dir):
    decoder = SpeculativeDecoder(load(llama_dir))
    greedy = decoder.generate([[5, 6, 7]], SamplingParams(max_tokens=12), 0)[0].output_ids
    tiny = decoder.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1e-39,
                                                        seed=3), 0)[0].output_ids
    assert tiny == greedy


def test_a_max_model_len_beyond_the_model_or_the_kv_cache_is_refused_at_start(llama_dir):
    with pytest.raises(ModelConfigError, match="exceeds the model's context of 512"):
        ModelRunner(RunnerConfig(str(llama_dir), max_model_len=513))
    with pytest.raises(ModelConfigError, match=r"does not fit the KV cache.*at most (\d+)"):
        ModelRunner(RunnerConfig(str(llama_dir), max_model_len=512, kv_cache_mb=0.05))
    runner = ModelRunner(RunnerConfig(str(llama_dir), max_model_len=300))
    assert runner.max_model_len == 300
    sized = dict(kv_cache_mb=None, max_model_len=512)  # from memory, with a share too small
    share = 12 * 2**10 / ram_bytes()[0]  # 12 KiB of this machine: a block or two
    with pytest.raises(ModelConfigError, match="does not fit.*--gpu-memory-utilization"):
        ModelRunner(RunnerConfig(str(llama_dir), memory_utilization=share, **sized))
    with pytest.raises(ModelConfigError, match="holds no KV block.*--gpu-memory-utilization"):
        ModelRunner(RunnerConfig(str(llama_dir), memory_utilization=1e-12, **sized))
    with pytest.raises(RequestError, match="context is 300"):
        SpeculativeDecoder(runner).new_sequence([1] * 300, SamplingParams())


def test_a_kv_cache_sized_from_memory_holds_a_full_batch_on_a_cpu(llama_dir):
    """No --kv-cache-mb: on a CPU, what max_num_seqs sequences of max_model_len use (the
    demo-sized share of RAM allows more)."""
    cfg = RunnerConfig(str(llama_dir), kv_cache_mb=None, max_model_len=256, max_num_seqs=3)
    assert ModelRunner(cfg).blocks.num_blocks * cfg.block_size == 3 * 256


def test_an_eos_id_outside_the_vocabulary_is_dropped_with_a_warning(model_copy, caplog):
    """config.json and generation_config.json both name EOS ids (their union ends a
    sequence); one past the vocabulary can never come, so it is left out, with a warning,
    and unconstrained and constrained generation go on (the grammar engine refused it)."""
    edit_config(model_copy, eos_token_id=10000)
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    with caplog.at_level("WARNING"):
        decoder = SpeculativeDecoder(load(model_copy, kv_cache_mb=8))
    assert decoder.eos_token_ids == {2, 3} and "eos_token_id 10000" in caplog.text
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(decoder.generate([[5, 6, 7]], greedy, 0)[0].output_ids) == 6
    digits = replace(greedy, structured_output=StructuredOutput("regex", "[0-9]+"))
    assert decoder.generate([[5, 6, 7]], digits, 0)[0].output_ids


def test_a_vocabulary_the_grammar_engine_refuses_fails_constrained_requests_only(
        model_copy):
    """A tokenizer.json with more tokens than the model's vocabulary: llguidance refuses
    it, which a constrained request is told; the others never build it."""
    (model_copy / "tokenizer.json").write_bytes(
        (paths.demo_target_dir() / "tokenizer.json").read_bytes())  # 4,096 tokens > 512
    decoder = SpeculativeDecoder(load(model_copy, kv_cache_mb=8))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert len(decoder.generate([[5, 6, 7]], greedy, 0)[0].output_ids) == 4
    digits = replace(greedy, structured_output=StructuredOutput("regex", "[0-9]+"))
    with pytest.raises(RequestError, match="grammar engine refuses its tokenizer.*4096"):
        decoder.new_sequence([5, 6, 7], digits)


def test_a_folder_with_only_a_sentencepiece_model_is_converted_once(model_copy, tmp_path,
                                                                    monkeypatch):
    """No tokenizer.json, SentencePiece's tokenizer.model: converted as transformers
    converts it (the same ids), kept, and used by the grammar engine too; without
    transformers, an error that says how to write tokenizer.json."""
    import builtins
    import inspect

    import sentencepiece
    from transformers import AutoTokenizer

    from outrider.core import tokenizer as tokenizer_module
    from outrider.core.grammar import Grammars

    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(tokenizer_module.TokenizerError, match=r"no tokenizer.json$"):
        tokenizer_module.Tokenizer(model_copy)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(inspect.getsource(json).splitlines()), vocab_size=400,
        model_prefix=str(model_copy / "tokenizer"), model_type="bpe", byte_fallback=True,
        minloglevel=2)
    (model_copy / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"}))
    monkeypatch.setattr(tokenizer_module, "CONVERTED_CACHE", tmp_path / "cache")
    conversions = []
    convert = tokenizer_module._convert_sentencepiece
    monkeypatch.setattr(tokenizer_module, "_convert_sentencepiece",
                        lambda *a: (conversions.append(a), convert(*a)))
    ours = tokenizer_module.Tokenizer(model_copy)
    theirs = AutoTokenizer.from_pretrained(str(model_copy))
    for text in ("def f(x): return 1", "two  spaces\nand é ünïcode 🙂"):
        assert ours.encode(text) == theirs(text).input_ids
    assert ours.path.parent.parent == tmp_path / "cache"
    written = ours.path.stat()
    # once: later loads (a second tokenizer, the grammar engine's) read what was kept
    again = tokenizer_module.Tokenizer(model_copy)
    assert Grammars.for_model(model_copy, 512, [2]) is not None
    assert len(conversions) == 1 and again.path == ours.path
    assert (again.path.stat().st_ino, again.path.stat().st_mtime_ns) == (
        written.st_ino, written.st_mtime_ns)
    real_import = builtins.__import__
    monkeypatch.setattr(tokenizer_module, "CONVERTED_CACHE", tmp_path / "empty")
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (
        (_ for _ in ()).throw(ImportError(name)) if name == "transformers"
        else real_import(name, *a, **k)))
    with pytest.raises(tokenizer_module.TokenizerError, match="only a SentencePiece "
                                                              "tokenizer.model.*save_pretrained"):
        tokenizer_module.Tokenizer(model_copy)
