"""The reference agent's storage: a pool of files on disk, and a bounded in-memory instance buffer.

PoolDir stands for the shared pool (Mooncake Store, LMCache's remote backend): one file per block,
named by the block's hash. HbmBuffer stands for the instance's HBM: a byte budget, least recently
used first out, except that a pin keeps a block until its time-to-live and a demote puts a block
first in line to go (until a use, or the demote's cancel, puts it back in LRU order). The bytes
are real (read from disk, held in memory) so that a transfer's measured seconds mean something;
the buffer is not GPU memory.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvprefetch_client.errors import KvpError
from kvprefetch_client.events import BlockHash

# A string hash made only of these is used as a file name as it is; anything else (a '/', '..',
# non-ASCII) is hashed, so no block hash can name a path outside the pool.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
_READ_CHUNK_BYTES = 8 << 20


def block_file_name(block_hash: BlockHash) -> str:
    """`46.kv` for the int 46, `s-ab12.kv` for the string "ab12", `h-<blake2b>.kv` otherwise.

    Ints and strings get different names because 46 and "46" are different blocks.
    """
    if isinstance(block_hash, int):
        return f"{block_hash}.kv"
    if _SAFE_NAME.fullmatch(block_hash):
        return f"s-{block_hash}.kv"
    return f"h-{hashlib.blake2b(block_hash.encode(), digest_size=16).hexdigest()}.kv"


class PoolDir:
    """The pool: a directory with one file per block hash (see block_file_name)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    def path_for(self, block_hash: BlockHash) -> Path:
        return self.directory / block_file_name(block_hash)

    def has(self, block_hash: BlockHash) -> bool:
        return self.path_for(block_hash).is_file()

    def read(self, block_hash: BlockHash) -> bytes:
        """The block's bytes; FileNotFoundError when the pool does not hold it."""
        with open(self.path_for(block_hash), "rb", buffering=0) as f:
            chunks = []
            while chunk := f.read(_READ_CHUNK_BYTES):
                chunks.append(chunk)
        return b"".join(chunks)

    def write(self, block_hash: BlockHash, data: bytes) -> Path:
        """Put a block in the pool (tests, demos, a writer's side); atomic by rename."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(block_hash)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return path


class BufferFull(KvpError):
    """The buffer cannot take a block without evicting pinned or protected blocks."""


@dataclass(slots=True)
class _Block:
    data: bytes
    pinned_until_ts: float | None = None
    used: int = 0  # its last use's stamp: its place in LRU order, should a demotion be withdrawn
    demoted: bool = False


class HbmBuffer:
    """A bounded byte store, least recently used first out; pins and demotes bend the order.

    Not thread-safe: the agent's loop is its only user. Times are the caller's clock (`now`).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        # First in the dict = next to go: the demoted blocks, then the rest by last use.
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        self._uses = itertools.count(1)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> list[BlockHash]:
        """Every block held, next to go first."""
        return list(self._blocks)

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes (a use: it becomes the last to go), None when absent."""
        block = self._blocks.get(block_hash)
        if block is None:
            return None
        self._used(block_hash, block)
        return block.data

    def _used(self, block_hash: BlockHash, block: _Block) -> None:
        """A use, by any session, outranks a demotion."""
        block.used = next(self._uses)
        block.demoted = False
        self._blocks.move_to_end(block_hash)

    def is_pinned(self, block_hash: BlockHash, now: float) -> bool:
        block = self._blocks.get(block_hash)
        return (
            block is not None and block.pinned_until_ts is not None and block.pinned_until_ts > now
        )

    def pinned_bytes(self, now: float) -> int:
        return sum(
            len(b.data)
            for b in self._blocks.values()
            if b.pinned_until_ts is not None and b.pinned_until_ts > now
        )

    def put(
        self, block_hash: BlockHash, data: bytes, now: float, protect: Collection[BlockHash] = ()
    ) -> list[BlockHash]:
        """Hold the block (the last to go); returns the blocks evicted to make room.

        Pinned blocks and those in `protect` (the rest of the order being landed) are never
        evicted; when room cannot be made without them BufferFull is raised and nothing changes.
        """
        old = self._blocks.get(block_hash)
        need = len(data) - (len(old.data) if old is not None else 0)
        victims: list[BlockHash] = []
        free = self.capacity_bytes - self.used_bytes
        if need > free:
            for h, block in self._blocks.items():
                if free >= need:
                    break
                if h == block_hash or h in protect:
                    continue
                if block.pinned_until_ts is not None and block.pinned_until_ts > now:
                    continue
                victims.append(h)
                free += len(block.data)
            if free < need:
                raise BufferFull(
                    f"block {block_hash!r} needs {len(data)} bytes; the buffer holds "
                    f"{self.capacity_bytes} bytes, {self.used_bytes} in use, "
                    f"{self.pinned_bytes(now)} of them pinned"
                )
        for h in victims:
            self.used_bytes -= len(self._blocks.pop(h).data)
        if old is not None:
            self.used_bytes -= len(old.data)
            old.data = data
            self._used(block_hash, old)
        else:
            self._blocks[block_hash] = _Block(data, used=next(self._uses))
        self.used_bytes += len(data)
        return victims

    def missing(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        return [h for h in block_hashes if h not in self._blocks]

    def pin(self, block_hashes: Sequence[BlockHash], until_ts: float) -> int:
        """Keep the blocks held until `until_ts` (a longer pin already there stays); returns their
        bytes. Absent blocks are skipped (the caller checks `missing` first)."""
        pinned = 0
        for h in block_hashes:
            block = self._blocks.get(h)
            if block is None:
                continue
            if block.pinned_until_ts is None or block.pinned_until_ts < until_ts:
                block.pinned_until_ts = until_ts
            pinned += len(block.data)
        return pinned

    def demote(self, block_hashes: Sequence[BlockHash]) -> int:
        """Make the blocks the next to go, unpinned, in the order given; returns their bytes."""
        demoted = 0
        for h in reversed(block_hashes):
            block = self._blocks.get(h)
            if block is None:
                continue
            block.pinned_until_ts = None
            block.demoted = True
            self._blocks.move_to_end(h, last=False)
            demoted += len(block.data)
        return demoted

    def unpin(self, block_hashes: Iterable[BlockHash]) -> None:
        """A pin withdrawn: the blocks go in LRU order again."""
        for h in block_hashes:
            block = self._blocks.get(h)
            if block is not None:
                block.pinned_until_ts = None

    def undemote(self, block_hashes: Iterable[BlockHash]) -> None:
        """A demotion withdrawn: the blocks go back to their places in LRU order (their last
        use), behind the blocks still demoted."""
        changed = False
        for h in block_hashes:
            block = self._blocks.get(h)
            if block is not None and block.demoted:
                block.demoted = False
                changed = True
        if not changed:
            return
        demoted = [(h, b) for h, b in self._blocks.items() if b.demoted]
        rest = sorted(
            ((h, b) for h, b in self._blocks.items() if not b.demoted),
            key=lambda item: item[1].used,
        )
        self._blocks = OrderedDict(demoted + rest)
