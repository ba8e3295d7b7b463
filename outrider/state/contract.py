"""What both homes of the shared state keep alike: the error, the bound on acceptance
entries and the rate limit's parameters."""

from __future__ import annotations

from typing import NamedTuple

from outrider.v1 import state_pb2 as st

# (model pair, workload tag) statistics kept at most: any client may send a new tag with
# every request, so tags beyond these share their pair's untagged statistics
MAX_ACCEPTANCE_ENTRIES = 1024


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached right now."""


def rate_limit_interval_ms(record: st.ApiKeyRecord) -> tuple[float, float]:
    """GCRA parameters: one request per interval, `burst` at once."""
    interval = 60_000.0 / record.requests_per_minute
    return interval, interval * (max(1, record.burst) - 1)


class Resumable(NamedTuple):
    """A request's journal found by a router resuming it (docs/DESIGN.md §9.4)."""

    record: st.JournalRecord
    token_ids: list[int]   # committed output tokens, to go on from (when claimed)
    is_claimed: bool       # now this router's to run; False: running elsewhere, or finished
