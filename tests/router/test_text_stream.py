"""Incremental detokenisation and stop strings, token by token and chunk by chunk."""

from __future__ import annotations

import pytest
from outrider.router.text_stream import TextStream

from outrider import paths
from outrider.core.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "def héllo(x):\n    return '世界 🎉' * x  # ünïcode\n\nclass Bar:\n    pass\n"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(paths.demo_target_dir())


def chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_deltas_join_to_the_text_and_never_split_a_character(tok, size):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(c) for c in chunks(ids, size)] + [detok.flush()]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_do_span_tokens_here(tok):
    """The property above is tested for real: some character needs several tokens."""
    ids = tok.encode("🎉")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize("stop", ["class Bar", "\n\n", "🎉", "x  # ü"])
def test_stop_string_across_chunks_ends_the_text_before_it(tok, size, stop):
    ids = tok.encode(TEXT)
    for include_stop in (False, True):
        stream = TextStream(tok, ("never appears", stop), include_stop)
        out = ""
        for c in chunks(ids, size):
            out += stream.push(c)
            if stream.is_stopped:
                break
        out += stream.finish()
        assert stream.is_stopped
        assert out == TEXT[:TEXT.index(stop) + len(stop) * include_stop]
    # the tokens consumed are exactly those needed to complete the stop string
    assert stop in tok.decode(ids[:stream.num_tokens])
    assert stop not in tok.decode(ids[:stream.num_tokens - 1])


def test_no_stop_releases_everything_at_the_end(tok):
    ids = tok.encode(TEXT)
    stream = TextStream(tok, ("pass\nZZ",))  # the text ends with a prefix of it: held back
    out = "".join(stream.push(c) for c in chunks(ids, 4))
    assert TEXT.startswith(out) and out != TEXT
    assert out + stream.finish() == TEXT and not stream.is_stopped
    assert stream.num_tokens == len(ids)


def test_the_earliest_stop_ends_the_text_and_is_kept_whole_when_asked(tok):
    stream = TextStream(tok, ("Bar:", "class"), include_stop=True)
    assert stream.push(tok.encode(TEXT)) + stream.finish() == TEXT[:TEXT.index("class") + 5]


def test_special_tokens_are_skipped_unless_kept(tok):
    ids = [*tok.encode("x = 1"), *tok.encode("<|endoftext|>", add_special_tokens=False)]
    assert len(ids) == len(tok.encode("x = 1")) + 1  # one special token
    for skip, shown in ((True, "x = 1"), (False, "x = 1<|endoftext|>")):
        stream = TextStream(tok, (), skip_special_tokens=skip)
        assert stream.push(ids) + stream.finish() == shown
