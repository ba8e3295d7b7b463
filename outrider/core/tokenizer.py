"""Tokenizer from a checkpoint's tokenizer.json (Hugging Face `tokenizers`)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from outrider.core.hf_config import read_config

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """tokenizer.json is missing or unreadable."""


CONVERTED_CACHE = Path.home() / ".cache" / "outrider" / "tokenizers"


def tokenizer_file(model_dir: str | Path) -> Path:
    """The folder's tokenizer.json. A folder with only SentencePiece's tokenizer.model gets
    one converted from it as transformers converts it (the tokenizers library reads no
    .model file), once, kept in CONVERTED_CACHE by the content of the files it reads;
    where transformers or sentencepiece is not installed, an error says how to write it."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return path
    model = Path(model_dir) / "tokenizer.model"
    if not model.is_file():
        raise TokenizerError(f"{model_dir}: no tokenizer.json")
    digest = hashlib.sha256(model.read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            digest.update((Path(model_dir) / name).read_bytes())
    converted = CONVERTED_CACHE / digest.hexdigest()[:16] / "tokenizer.json"
    if not converted.is_file():
        _convert_sentencepiece(Path(model_dir), converted)
    return converted


def _convert_sentencepiece(model_dir: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            f"{model_dir}: no tokenizer.json, only a SentencePiece tokenizer.model: install "
            f"transformers and sentencepiece (it is converted once), or write it with python "
            f"-c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained("
            f"'{model_dir}').save_pretrained('{model_dir}')\"") from None
    try:
        backend = AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer
    except Exception as exc:  # transformers raises many kinds (ImportError, ValueError, ...)
        raise TokenizerError(f"{model_dir}/tokenizer.model: transformers could not convert it "
                             f"to a tokenizer.json ({exc})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    backend.save(str(partial))
    partial.replace(out)  # whole or not at all, whoever converts at the same time
    log.warning("%s: tokenizer.model converted to %s", model_dir, out)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = tokenizer_file(model_dir)
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

    @property
    def special_tokens(self) -> dict[int, str]:
        """The special (added) tokens, id -> text."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                if t.special}

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


def vocab_fingerprint(model_dir: str | Path) -> str:
    """A checkpoint's vocabulary in 16 hex digits: its tokenizer's tokens and ids and its
    model's vocabulary size. A draft replica tells its targets apart by it, and a router
    the target replicas of its models (a token id means nothing in another vocabulary)."""
    try:
        vocab = sorted(Tokenizer(model_dir).vocab.items())
    except TokenizerError:
        vocab = []
    size = int(read_config(model_dir)["vocab_size"])
    return hashlib.sha256(json.dumps([size, vocab]).encode()).hexdigest()[:16]


def shares_vocabulary(target_dir: str | Path, draft_dir: str | Path) -> bool:
    """Whether a draft proposes in the target's ids as it is: its vocabulary size is the
    target's, and it has no tokenizer.json of its own (it uses the target's) or one of
    the same tokens and ids. Otherwise it proposes through text, if at all
    (engine/cross_vocab.py)."""
    size = lambda d: int(read_config(d)["vocab_size"])  # noqa: E731
    if size(target_dir) != size(draft_dir):
        return False
    try:
        draft = Tokenizer(draft_dir).vocab
    except TokenizerError:
        return True
    return draft == Tokenizer(target_dir).vocab
