"""The cluster's numbers, in one place: a block's bytes, the links into an instance's HBM, the
prefill rate, and what moving or recomputing a context costs by them.

Built once from the settings (`ClusterSpec.from_settings`) by the engine, or from a simulated
scenario (sim/scenario.py `Scenario.cluster`), and read by the scheduler (its links and the
stall an order avoids), route hints, request outcomes and the simulator's cluster model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

# The defaults (the Settings' too): a 100 Gb/s NIC from the shared pool, PCIe 5 from host DRAM,
# 70B prefill on one GPU, prefetch taking half of each link so demand loads are never starved.
POOL_LINK_BYTES_PER_SECOND = 12.5e9
HOST_LINK_BYTES_PER_SECOND = 50e9
PREFILL_TOKENS_PER_SECOND = 20_000.0
LINK_SHARE = 0.5
BLOCK_TOKENS = 512

SourceTier = Literal["host", "pool"]


class ClusterSettings(Protocol):
    bytes_per_token: int
    block_tokens: int
    pool_link_bytes_per_second: float
    host_link_bytes_per_second: float
    prefill_tokens_per_second: float


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    bytes_per_token: int
    block_tokens: int = BLOCK_TOKENS
    pool_link_bytes_per_second: float = POOL_LINK_BYTES_PER_SECOND
    host_link_bytes_per_second: float = HOST_LINK_BYTES_PER_SECOND
    prefill_tokens_per_second: float = PREFILL_TOKENS_PER_SECOND
    # The share of each link prefetch may book (the scheduler's; KVP_PREFETCH_LINK_SHARE).
    link_share: float = LINK_SHARE

    @classmethod
    def from_settings(
        cls, settings: ClusterSettings, *, link_share: float = LINK_SHARE
    ) -> ClusterSpec:
        """From app.core.config.Settings, or anything carrying the same names (a Scenario)."""
        return cls(
            bytes_per_token=settings.bytes_per_token,
            block_tokens=settings.block_tokens,
            pool_link_bytes_per_second=settings.pool_link_bytes_per_second,
            host_link_bytes_per_second=settings.host_link_bytes_per_second,
            prefill_tokens_per_second=settings.prefill_tokens_per_second,
            link_share=getattr(settings, "prefetch_link_share", link_share),
        )

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def link_bytes_per_second(self, source: str) -> float:
        """The link from `source` ("host" or "pool") into an instance's HBM."""
        return (
            self.host_link_bytes_per_second if source == "host" else self.pool_link_bytes_per_second
        )

    def load_seconds(self, nbytes: float, source: str) -> float:
        """Time to last byte of `nbytes` over the whole link from `source`."""
        return nbytes / self.link_bytes_per_second(source)

    def recompute_seconds(self, tokens: float) -> float:
        """Prefill time of `tokens` that are held nowhere."""
        return tokens / self.prefill_tokens_per_second
