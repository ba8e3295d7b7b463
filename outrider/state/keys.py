"""The key scheme in Redis: every key Outrider writes starts with PREFIX, so one Redis can
hold other data beside it."""

from __future__ import annotations

PREFIX = "outrider:"
REPLICAS = f"{PREFIX}replicas"                  # set of replica addresses
ACCEPTANCE_NAMES = f"{PREFIX}acceptance-keys"   # set of "pair:tag" statistics names
ACCEPTANCE = f"{PREFIX}acceptance:"             # + "pair:tag": hash t<j>, a<j>


def replica(address: str) -> str:
    return f"{PREFIX}replica:{address}"


def acceptance(pair: str, tag: str) -> str:
    return f"{ACCEPTANCE}{pair}:{tag}"


def api_key(key_hash: str) -> str:
    return f"{PREFIX}key:{key_hash}"


def rate(key_hash: str) -> str:
    return f"{PREFIX}rate:{key_hash}"


def journal(request_id: str) -> tuple[str, str, str]:
    """A request's journal: its record, its committed tokens and its claim."""
    key = f"{PREFIX}journal:{request_id}"
    return key, f"{key}:out", f"{key}:claim"


def draft(pair: str) -> tuple[str, str, str]:
    """A pair's draft versions: the trainer lease, the latest version, the weights prefix."""
    base = f"{PREFIX}draft:{pair}:"
    return base + "trainer", base + "latest", base + "weights:"
