"""Which LoRA adapter a request runs under, as the router hands it to a worker.

An adapter is named by its clients (the request's ``model``) but known to the workers by its
content: ``digest`` is the sha256 of its files (``pdserve.models.lora.adapter_digest``), taken
when the adapter was registered. A worker loads the adapter from ``path`` on first use and
refuses it when the files there no longer have that digest, so a prefix-cache block computed
under one adapter's weights is never matched by a request for other weights of the same name
(the digest roots the block hashes: ``engine.kv_cache.prefix_hash.adapter_root_hash``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AdapterRef:
    """A registered LoRA adapter: its served name, its files, and their digest."""

    name: str  # what clients put in ``model``
    path: str  # the PEFT folder (adapter_config.json + adapter_model.safetensors)
    digest: str  # sha256 (hex) of the adapter's files when it was registered

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 256:
            raise ValueError(f"adapter name must be a non-empty string of at most 256 "
                             f"characters, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"adapter {self.name!r}: path must be a non-empty string")
        if not isinstance(self.digest, str) or not _DIGEST.fullmatch(self.digest):
            raise ValueError(f"adapter {self.name!r}: digest must be 64 lowercase hex digits, "
                             f"got {self.digest!r}")
