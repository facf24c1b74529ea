"""Cluster scenarios: the numbers the cluster model runs on, read from TOML files and validated.

Every number in the shipped files under data/scenarios/ is cited to ../shared/REFERENCE.md.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.core.bundle import SCENARIO_DIR
from app.core.cluster import HOST_LINK_BYTES_PER_SECOND, ClusterSettings, ClusterSpec
from app.core.errors import ConfigError
from sim.compute import DEFAULT_STEP_TOKENS
from sim.signals import SignalSettings


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    model_name: str = "Llama-3.1-70B bf16"
    bytes_per_token: int = Field(gt=0)
    block_tokens: int = Field(512, gt=0)
    instances: int = Field(ge=1, le=4096)
    hbm_kv_bytes: int = Field(gt=0, description="HBM set aside for KV cache, per instance")
    host_kv_bytes: int = Field(
        0, ge=0, description="host-DRAM KV tier per instance; 0: no such tier"
    )
    pool_link_bytes_per_second: float = Field(
        gt=0, description="inbound link from the shared pool, per instance"
    )
    host_link_bytes_per_second: float = Field(
        HOST_LINK_BYTES_PER_SECOND, gt=0, description="host DRAM to GPU (PCIe), per instance"
    )
    prefill_tokens_per_second: float = Field(gt=0)
    decode_seconds_per_token: float = Field(gt=0)
    max_running_requests: int = Field(ge=1, description="concurrency limit per instance")
    sticky_overflow_queue: int = Field(
        8, ge=0, description="sticky router overflows past this queue length"
    )
    # How a prefetch's blocks become usable (an assumption, docs/data-science/replay.md):
    # "chunked", chunk by chunk as each crosses the link, head first, as LMCache loads in
    # 256-token chunks and vLLM's connector loads asynchronously; "whole", only when the whole
    # transfer has landed (the model before issue 27, kept for comparison).
    landing: Literal["chunked", "whole"] = "chunked"
    chunk_tokens: int = Field(
        256, gt=0, description="tokens per landing chunk (LMCache's default chunk size)"
    )
    # Arrivals of requests that carry `after_seconds` (an agent trace): "closed", each that long
    # after its session's previous request finished in the simulation, so serving a call faster
    # brings the next one sooner, as in an agent loop; "open", at its recorded timestamp. A trace
    # without them (the Mooncake chat traces) is open-loop either way.
    arrivals: Literal["closed", "open"] = "closed"
    # How an instance's running requests share its GPU (an assumption, sim/compute.py):
    # "independent", each request's prefill and decode as if alone on it; "shared", in
    # chunked-prefill steps of `step_tokens` (vLLM's max_num_batched_tokens), so a long prefill
    # or recompute slows every request beside it.
    compute: Literal["independent", "shared"] = "independent"
    step_tokens: int = Field(DEFAULT_STEP_TOKENS, gt=0, description="token budget of a step")
    # Early signals before returning turns, an assumed model (sim/signals.py); off by default.
    signals: SignalSettings = Field(default_factory=SignalSettings)

    @property
    def cluster(self) -> ClusterSpec:
        """The numbers the service's parts read (app/core/cluster.py), as the engine's settings
        would carry them."""
        # A frozen model: its fields are read-only where the ClusterSettings protocol declares
        # settable attributes; the names and types are the same.
        return ClusterSpec.from_settings(cast("ClusterSettings", self))

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    @property
    def chunk_blocks(self) -> int:
        """Blocks per landing chunk: a chunk is a whole number of blocks (one, when blocks are
        at least `chunk_tokens` long, as the shipped scenarios' 512-token blocks are)."""
        return max(1, self.chunk_tokens // self.block_tokens)

    @property
    def hbm_blocks(self) -> int:
        return self.hbm_kv_bytes // self.block_bytes

    @property
    def host_blocks(self) -> int:
        return self.host_kv_bytes // self.block_bytes

    @model_validator(mode="after")
    def _fits_a_request(self) -> Scenario:
        if self.hbm_blocks < 1:
            raise ValueError(
                f"hbm_kv_bytes ({self.hbm_kv_bytes}) holds not even one "
                f"{self.block_bytes}-byte block"
            )
        return self


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A shipped scenario by name (`default`, `fast-link`, `tight-hbm`, `host-tier`, `busy`) or a
    TOML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIO_DIR / f"{name_or_path}.toml"
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
        raise ConfigError(f"no scenario {str(name_or_path)!r} (shipped: {known})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    doc.setdefault("name", path.stem)
    try:
        return Scenario.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "scenario"
        raise ConfigError(
            f"{path}: {field}: {first['msg'].removeprefix('Value error, ')}"
        ) from None
