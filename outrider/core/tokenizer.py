"""Tokenizer from a checkpoint's tokenizer.json (Hugging Face `tokenizers`)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(ValueError):
    """tokenizer.json is missing or unreadable."""


def _sentencepiece_hint(model_dir: str | Path) -> str:
    """How to get a tokenizer.json from a folder that holds only SentencePiece's model (the
    tokenizers library reads no .model file; transformers converts it, once)."""
    if not (Path(model_dir) / "tokenizer.model").is_file():
        return ""
    return (f" (only a SentencePiece tokenizer.model): write one once with python -c "
            f"\"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained("
            f"'{model_dir}').save_pretrained('{model_dir}')\" (needs transformers and "
            f"sentencepiece)")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json{_sentencepiece_hint(model_dir)}")
        self.path = path
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{path}: unreadable tokenizer ({exc})") from exc

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the Rust side takes only valid Unicode: no lone surrogates
            raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even part of a UTF-8 character (what OpenAI's
        logprob `bytes` carry): byte-level BPE pieces mapped back to their bytes,
        `<0xHH>` byte-fallback pieces, sentencepiece's ▁ as a space."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_of_char() if self._is_byte_level else {}
        if table and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _is_byte_level(self) -> bool:
        return "ByteLevel" in repr(self._tok.decoder)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte is a printable character (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each push decodes only a short window — the tokens since the last emitted text plus
    a few before them for context (tokenizers may render a token differently after
    another) — so a long generation costs O(tokens), not O(tokens²). Bytes of a
    multi-byte character split across tokens are held back until it is complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_start = 0  # context window start
        self._read_start = 0    # tokens before this are already in emitted text

    def push(self, new_ids: list[int]) -> str:
        self.token_ids.extend(new_ids)
        delta = self._unread_text()
        if not delta or delta.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_start, self._read_start = self._read_start, len(self.token_ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        delta = self._unread_text()
        self._prefix_start = self._read_start = len(self.token_ids)
        return delta

    def _unread_text(self) -> str:
        """Text of the tokens from _read_start on, decoded after their context window."""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.token_ids[self._prefix_start:self._read_start], skip)
        text = self.tokenizer.decode(self.token_ids[self._prefix_start:], skip)
        return text[len(prefix):]
