"""Structured outputs enforced (docs/DESIGN.md §3.8): a constraint (`StructuredOutput`,
outrider/core/structured.py) is checked where the request enters and applied where
tokens are chosen.

Torch-free: the router checks constraints with `Grammars.check`; the target and the draft
mask the logits of every row with `Grammars.row_masks` / `next_mask`. The grammar engine
is llguidance (chosen by measurement against xgrammar: scripts/grammar_engines.py). Masks
are llguidance's packed bitmasks: int32 words, bit t of word t // 32 set when token t is
allowed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from outrider.core.structured import StructuredOutput, StructuredOutputError
from outrider.core.tokenizer import TokenizerError, tokenizer_file

MAX_COMPILED = 64  # compiled grammars kept per process (the newest)


@dataclass
class _Tracked:
    """A sequence's matcher: it has consumed `held` (output tokens, then speculative ones
    past `firm`, which are rolled back lazily when the next call's tokens differ)."""

    matcher: LLMatcher
    held: list[int] = field(default_factory=list)
    firm: int = 0          # held[:firm] were committed output when last seen
    is_broken: bool = False  # committed output the grammar refused (a resumed journal)


class Grammars:
    """One vocabulary's compiled grammars, and a matcher per constrained sequence."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_file = Path(tokenizer_file)
        self._tokenizer: LLTokenizer | None = None  # built when a constraint first needs it
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._compiling = threading.Lock()  # requests are checked on any thread
        self._sequences: dict[object, _Tracked] = {}
        eos = np.zeros(self.num_words * 32, dtype=bool)
        self._eos_ids = sorted({t for t in eos_token_ids if t < vocab_size})
        eos[self._eos_ids] = True
        self._eos_only = np.packbits(eos, bitorder="little").view(np.int32)  # [words]

    @property
    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary, built on first use, so that a vocabulary
        it refuses fails constrained requests (naming why) and nothing else."""
        if self._tokenizer is None:
            try:
                self._tokenizer = LLTokenizer(self._tokenizer_file.read_text(),
                                              n_vocab=self.vocab_size,
                                              eos_token=self._eos_ids or None)
            except (ValueError, RuntimeError, OSError) as exc:
                raise StructuredOutputError(
                    f"structured outputs are not available for this model: the grammar "
                    f"engine refuses its tokenizer ({self._tokenizer_file}): {exc}") from None
        return self._tokenizer

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int,
                  eos_token_ids: Sequence[int]) -> Grammars | None:
        """The model's, or None when its folder holds no tokenizer.json."""
        try:
            return cls(tokenizer_file(model_dir), vocab_size, eos_token_ids)
        except TokenizerError:
            return None

    def check(self, so: StructuredOutput) -> None:
        """Compiles it (or finds it compiled); raises StructuredOutputError naming it."""
        self._prototype(so)

    def _prototype(self, so: StructuredOutput) -> LLMatcher:
        with self._compiling:
            matcher = self._compiled.get(so.key)
            if matcher is not None:
                self._compiled.move_to_end(so.key)
                return matcher
        error = LLMatcher.validate_grammar(so.grammar, self.tokenizer)
        if error:
            raise StructuredOutputError(f"{so.field}: {error.strip()}")
        matcher = LLMatcher(self.tokenizer, so.grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"{so.field}: {matcher.get_error().strip()}")
        with self._compiling:
            self._compiled[so.key] = matcher
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def release(self, seq_key: object) -> None:
        self._sequences.pop(seq_key, None)

    def row_masks(self, seq_key: object, so: StructuredOutput, token_ids: Sequence[int],
                  prompt_len: int, drafted: Sequence[int]) -> np.ndarray:
        """[len(drafted) + 1, words]: row j allows what may follow the output
        (token_ids[prompt_len:]) + drafted[:j]. After a drafted token the matcher cannot
        take, rows allow only EOS: either its own row refused it (verification rejects it,
        and the rows after are never used) or the grammar was complete and it was EOS (then
        only EOS may follow, as `_fill` says of a finished grammar)."""
        tracked = self._tracked(seq_key, so)
        masks = np.tile(self._eos_only, (len(drafted) + 1, 1))
        self._sync(tracked, token_ids, prompt_len, ())
        self._fill(tracked, masks[0])
        for j, token in enumerate(drafted):
            if tracked.is_broken or not tracked.matcher.try_consume_tokens([token]):
                break
            tracked.held.append(token)
            self._fill(tracked, masks[j + 1])
        return masks

    def next_mask(self, seq_key: object, so: StructuredOutput, token_ids: Sequence[int],
                  prompt_len: int, drafted: Sequence[int]) -> np.ndarray:
        """[words]: what may follow the output + drafted (a drafter's row); only EOS after
        tokens the matcher cannot take (as `row_masks`)."""
        tracked = self._tracked(seq_key, so)
        mask = self._eos_only.copy()
        if self._sync(tracked, token_ids, prompt_len, drafted) == len(drafted):
            self._fill(tracked, mask)
        return mask

    def forced_tokens(self, seq_key: object, so: StructuredOutput, token_ids: Sequence[int],
                      prompt_len: int, drafted: Sequence[int] = ()) -> list[int]:
        """The tokens the grammar forces after the output + drafted (the tokenized bytes
        no other choice can lead to, e.g. a schema's next key): free drafts (§3.8); none
        after tokens the matcher cannot take."""
        tracked = self._tracked(seq_key, so)
        if self._sync(tracked, token_ids, prompt_len, drafted) < len(drafted) \
                or tracked.is_broken:
            return []
        return tracked.matcher.compute_ff_tokens()

    def forced_end(self, seq_key: object, so: StructuredOutput, token_ids: Sequence[int],
                   prompt_len: int) -> int | None:
        """The EOS token when it alone may follow the output (the grammar is complete and
        takes nothing more), else None; None too with several EOS tokens, between which the
        target chooses."""
        tracked = self._tracked(seq_key, so)
        self._sync(tracked, token_ids, prompt_len, ())
        if len(self._eos_ids) != 1 or tracked.is_broken or not tracked.matcher.is_stopped():
            return None
        return self._eos_ids[0]

    def allowed_len(self, seq_key: object, so: StructuredOutput, token_ids: Sequence[int],
                    prompt_len: int, drafted: Sequence[int]) -> int:
        """How many of `drafted` the grammar takes, in order, after the output."""
        tracked = self._tracked(seq_key, so)
        return 0 if tracked.is_broken else self._sync(tracked, token_ids, prompt_len, drafted)

    def _tracked(self, seq_key: object, so: StructuredOutput) -> _Tracked:
        tracked = self._sequences.get(seq_key)
        if tracked is None:
            tracked = self._sequences[seq_key] = _Tracked(self._prototype(so).deep_copy())
        return tracked

    def _sync(self, tracked: _Tracked, token_ids: Sequence[int], prompt_len: int,
              drafted: Sequence[int]) -> int:
        """Brings the matcher to the output + drafted, reading only the output it has not
        seen (called per round and per drafted token: the output is never copied whole).
        The output only grows; a sequence whose output changed under it starts again.
        Returns how many drafted it consumed."""
        firm, num_output = tracked.firm, len(token_ids) - prompt_len
        if num_output < firm or (firm and token_ids[prompt_len + firm - 1]
                                 != tracked.held[firm - 1]):
            tracked.matcher.reset()
            tracked.held, tracked.firm, tracked.is_broken = [], 0, False
            firm = 0
        wanted = [*token_ids[prompt_len + firm:], *drafted]
        have = tracked.held[firm:]
        same = next((i for i, (a, b) in enumerate(zip(have, wanted)) if a != b),
                    min(len(have), len(wanted)))
        if len(have) > same:
            tracked.matcher.rollback(len(have) - same)
            del tracked.held[firm + same:]
        consumed = tracked.matcher.try_consume_tokens(wanted[same:]) if not tracked.is_broken else 0
        tracked.held += wanted[same:same + consumed]
        new_output = num_output - firm
        if same + consumed < new_output:
            tracked.is_broken = True  # committed tokens outside the grammar: end it
        tracked.firm = min(num_output, len(tracked.held))
        return max(0, same + consumed - new_output)

    def _fill(self, tracked: _Tracked, row: np.ndarray) -> None:
        if tracked.is_broken:
            row[:] = self._eos_only
            return
        tracked.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not row.any():  # nothing allowed (the grammar is done and EOS is ignored)
            row[:] = self._eos_only

