"""Tp=2 and tp=4 (gloo, separate processes) give tp=1's greedy output."""

from __future__ import annotations

import pytest

from tests.cli_utils import generate_json, run_cli

PROMPT = "def parse(value):\n    return"
ARGS = ("--max-tokens", "48", "--temperature", "0")


@pytest.fixture(scope="module")
def tp1_output(llama_dir):
    return generate_json("--target", str(llama_dir), "--gamma", "0", *ARGS, PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_tp1(llama_dir, tp1_output, tp):
    out = generate_json("--target", str(llama_dir), "--gamma", "0", "--tp", str(tp), *ARGS, PROMPT)
    assert out["token_ids"] == tp1_output["token_ids"]
    assert len(out["token_ids"]) > 0


@pytest.mark.slow
def test_tp2_with_draft_matches_tp1(llama_dir, draft_dir, tp1_output):
    out = generate_json("--target", str(llama_dir), "--draft", str(draft_dir), "--gamma", "4",
                        "--tp", "2", *ARGS, PROMPT)
    assert out["token_ids"] == tp1_output["token_ids"]
    assert out["speculation"]["draft_tokens"] > 0


def test_tp_that_does_not_divide_heads_is_refused(llama_dir):
    proc = run_cli("generate", "--local", "--target", str(llama_dir), "--tp", "3", PROMPT)
    assert proc.returncode == 1
    assert "tp=3 is not supported" in proc.stderr


def test_tp_larger_than_kv_heads_is_refused(llama_dir):
    proc = run_cli("generate", "--local", "--target", str(llama_dir), "--tp", "8", PROMPT)
    assert proc.returncode == 1
    assert "tp=8 does not divide num_key_value_heads (4)" in proc.stderr
