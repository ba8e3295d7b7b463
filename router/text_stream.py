"""Token ids in, text out, for one request: incremental detokenisation plus stop strings.

A stop string may arrive split over several steps, so text that could still be the
start of one is held back until it is either completed (generation stops before it)
or ruled out (it is released)."""

from __future__ import annotations

from outrider.core.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop  # the stop string that ends the text stays in it
        self._held = ""             # decoded text not yet released
        self.num_tokens = 0         # tokens consumed (up to the one completing a stop)
        self.is_stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Text released by these tokens. Tokens after a stop string are not consumed."""
        released = []
        for token in token_ids:
            if self.is_stopped:
                break
            self.num_tokens += 1
            self._held += self._detok.push([token])
            released.append(self._release())
        return "".join(released)

    def finish(self) -> str:
        """The end of generation: release what is held (no stop string can complete)."""
        if self.is_stopped:
            return ""
        self._held += self._detok.flush()
        text = self._release()
        text, self._held = text + self._held, ""
        return text

    def _release(self) -> str:
        found = [(at, s) for s in self._stop if (at := self._held.find(s)) >= 0]
        if found:
            at, stop = min(found, key=lambda f: f[0])  # the first to end; ties: listed first
            self.is_stopped = True
            text, self._held = self._held[:at + len(stop) * self._include_stop], ""
            return text
        keep = held_back(self._held, self._stop)
        cut = len(self._held) - keep
        text, self._held = self._held[:cut], self._held[cut:]
        return text



def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `markers`: what must wait
    for the next text before it can be shown (stop strings, a tool-call format's marker)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
