"""Tags under the cluster's secret on what workers and the pool manager write to Redis.

Anyone who reaches Redis can write any key, so what a reader acts on from there (a worker's
registry record, its drain mark, its KV event batches) carries an HMAC-SHA256 tag, stored
beside it, under a secret of the cluster's: the launcher derives it from the cluster's secret
as it derives the KV join token (``EmbeddedCluster.derived_secret``) and gives it to the
workers and routers in their specs (``record_key``). A tag covers a purpose and the exact
bytes a reader parses, each part length-prefixed, so no value can move to another field,
another worker or another purpose. A reader skips what does not verify and counts it.

What a tag cannot stop is a replay: something the cluster itself wrote before (an older
record or batch of the same worker) written back. The readers bound what that can do: a
heartbeat rewrites the record within a second, the pool manager re-marks its drains at every
reconcile, and the KV index skips batches it applied already.
"""

from __future__ import annotations

import hashlib
import hmac


class UntrustedError(ValueError):
    """A value read from Redis whose tag does not verify under the cluster's key."""


class RecordAuth:
    """Tags and checks values under one key (``secret``: the spec's ``record_key``)."""

    def __init__(self, secret: str | bytes) -> None:
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not key:
            raise ValueError("record_key must be non-empty: the cluster's key for what its "
                             "workers and pool manager write to Redis")
        self._key = key

    def tag(self, purpose: str, *parts: str | bytes) -> str:
        """The hex HMAC-SHA256 of ``purpose`` and ``parts``, each prefixed by its length."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (purpose, *parts):
            data = part.encode() if isinstance(part, str) else part
            mac.update(len(data).to_bytes(8, "big"))
            mac.update(data)
        return mac.hexdigest()

    def verifies(self, tag: str | bytes, purpose: str, *parts: str | bytes) -> bool:
        """Whether ``tag`` (as stored: hex text or its bytes) is :meth:`tag` of these; in
        constant time."""
        stored = tag.encode() if isinstance(tag, str) else bytes(tag)
        return hmac.compare_digest(stored, self.tag(purpose, *parts).encode())
