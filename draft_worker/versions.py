"""A model pair's draft versions, shared through Redis (docs/DESIGN.md §8.6).

One draft replica of a pair trains: the one holding the pair's trainer lease. Each
version it adopts it publishes, weights as safetensors bytes under their own key and
then the version index, in one script that first checks it still holds the lease (a
trainer cut off from Redis cannot overwrite its successor's versions). The other
replicas train nothing: they read the index and pull the versions they lack. When the
trainer goes, its lease lapses and another replica takes over, training on from the
version it serves. A Redis that cannot be reached leaves every replica serving the
weights it has."""

from __future__ import annotations

import math
import uuid

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from outrider.state import RedisStore, keys

LEASE_S = 60.0       # a trainer that stops renewing hands over after this long
KEEP_VERSIONS = 3    # weights kept in Redis: the newest, and two to fall back on

# KEYS[1] lease; ARGV: owner, lease ms. 1: held (taken or renewed), 0: another holds it.
_HOLD_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease, latest, weights prefix; ARGV: owner, weights, versions kept.
# The new version's number, or 0 when the caller no longer holds the lease.
_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local version = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
redis.call('SET', KEYS[3] .. version, ARGV[2])
redis.call('SET', KEYS[2], version)
redis.call('DEL', KEYS[3] .. (version - tonumber(ARGV[3])))
return version
"""


class SharedVersions:
    """The version index and weights of one pair's draft, from one replica's side."""

    def __init__(self, store: RedisStore, pair: str, lease_s: float = LEASE_S) -> None:
        self.store, self.lease_s = store, lease_s
        self.owner = uuid.uuid4().hex  # this replica, as a lease holder
        self._lease, self._latest, self._weights = keys.draft(pair)
        self._hold = store.script(_HOLD_LEASE)
        self._publish = store.script(_PUBLISH)

    def hold_lease(self) -> bool:
        """Take the trainer lease if it is free, renew it if it is ours; False: another
        replica trains. Raises StoreUnavailable."""
        ms = math.ceil(self.lease_s * 1000)
        return bool(self.store.call(lambda r: self._hold(
            keys=[self._lease], args=[self.owner, ms], client=r)))

    def publish(self, state: dict[str, torch.Tensor]) -> int | None:
        """Publish weights as the next version; its number, or None when the lease has
        gone to another replica meanwhile (the weights are then not published)."""
        blob = save_safetensors({k: v.contiguous() for k, v in state.items()})
        version = self.store.call(lambda r: self._publish(
            keys=[self._lease, self._latest, self._weights],
            args=[self.owner, blob, KEEP_VERSIONS], client=r))
        return int(version) or None

    def latest(self) -> int:
        raw = self.store.call(lambda r: r.get(self._latest))
        return int(raw) if raw is not None else 0

    def fetch(self, version: int) -> dict[str, torch.Tensor] | None:
        """A published version's weights; None when Redis no longer keeps them."""
        blob = self.store.call(lambda r: r.get(f"{self._weights}{version}"))
        return None if blob is None else load_safetensors(blob)
