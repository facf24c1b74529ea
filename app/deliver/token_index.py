"""The tokens behind block hashes, for a tier keyed by tokens (LMCache) rather than by hashes.

Orders name blocks by hash; LMCache names content by its token sequence from position 0 (its
chunk hashes are prefix-chained). `kv_blocks_stored` events carry the blocks' tokens when the
engine reports them (vLLM's BlockStored does), with the parent of the first block: this index
keeps, per block hash, its own tokens and its parent, so an order's token sequence is rebuilt by
walking each block's chain back to the root.

Bounded: at most `max_tokens` tokens held (in arrays, 8 bytes each; with the per-block overhead
about 22 bytes a token at 16-token blocks), least recently used first out. A block is used when
stored or walked; storing a block also touches its parent, so a chain that keeps growing keeps
its recent links. A chain whose ancestor was forgotten (or never reported) cannot be rebuilt:
`tokens_for` says which block is missing, and the order fails with that reason.

Told from the engine's ingest observer (possibly on the store thread) and read by the sink on the
event loop: one lock.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from app.core.errors import KvpError
from kvprefetch_client.events import BlockHash, Event, KvBlocksStored, VllmKvEvents

log = logging.getLogger(__name__)

# Token ids are vocabulary indices: a signed 64-bit slot holds any of them.
_TOKEN_TYPECODE = "q"
_TOKEN_MIN, _TOKEN_MAX = -(2**63), 2**63 - 1


class UnknownTokens(KvpError):
    """An order's tokens cannot be rebuilt; `str()` says which block is missing."""


@dataclass(frozen=True, slots=True)
class _Block:
    parent: BlockHash | None
    tokens: array


class TokenIndex:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.max_tokens = max_tokens
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        # Counted, not raised: a stored event whose tokens do not split evenly into its blocks.
        self.malformed_events = 0
        self.forgotten_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def tokens(self) -> int:
        return self._tokens

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer: learns the tokens of every kv_blocks_stored that carries them."""
        for e in events:
            if isinstance(e, KvBlocksStored):
                self._stored(e)
            elif isinstance(e, VllmKvEvents):
                for sub in e.expand():
                    if isinstance(sub, KvBlocksStored):
                        self._stored(sub)

    def _stored(self, e: KvBlocksStored) -> None:
        if not e.token_ids:
            return
        hashes = e.block_hashes
        tokens = e.token_ids
        # vLLM reports whole blocks, block_size tokens each.
        per_block = e.block_tokens or (len(tokens) // len(hashes) if hashes else 0)
        if per_block < 1 or len(tokens) != per_block * len(hashes):
            self.malformed_events += 1
            log.warning(
                "kv_blocks_stored %s: %d token ids do not make %d blocks of %s tokens; its tokens "
                "are not indexed",
                e.event_id,
                len(tokens),
                len(hashes),
                e.block_tokens,
            )
            return
        if any(t < _TOKEN_MIN or t > _TOKEN_MAX for t in tokens):
            self.malformed_events += 1
            log.warning("kv_blocks_stored %s: a token id outside 64 bits; not indexed", e.event_id)
            return
        with self._lock:
            parent = e.parent_block_hash
            if parent is not None and parent in self._blocks:
                self._blocks.move_to_end(parent)
            for i, h in enumerate(hashes):
                old = self._blocks.pop(h, None)
                if old is not None:
                    self._tokens -= len(old.tokens)
                block = _Block(
                    parent, array(_TOKEN_TYPECODE, tokens[i * per_block : (i + 1) * per_block])
                )
                self._blocks[h] = block
                self._tokens += len(block.tokens)
                parent = h
            self._shrink()

    def _shrink(self) -> None:
        while self._tokens > self.max_tokens and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self._tokens -= len(block.tokens)
            self.forgotten_blocks += 1

    def tokens_for(self, block_hashes: Sequence[BlockHash]) -> list[list[int]]:
        """The token sequences (each from position 0) that cover `block_hashes`: one per chain
        end among them (a block no other of them descends from), deepest chain first.

        Raises UnknownTokens when a block, or an ancestor of one, is not in the index."""
        with self._lock:
            covered: set[BlockHash] = set()
            chains: list[list[BlockHash]] = []
            # Walked from the last block: an order lists a chain oldest first, so its end comes
            # first and the blocks before it are covered by its walk.
            for end in reversed(block_hashes):
                if end in covered:
                    continue
                chain = self._chain(end)
                covered.update(chain)
                chains.append(chain)
            # A chain walked earlier may end inside a later one (blocks listed out of order):
            # keep only chains whose end no other chain passes through.
            inner = {h for c in chains for h in c[1:]}
            ends = [c for c in chains if c[0] not in inner]
            out: list[list[int]] = []
            for chain in sorted(ends, key=len, reverse=True):
                tokens: list[int] = []
                for h in reversed(chain):
                    self._blocks.move_to_end(h)
                    tokens.extend(self._blocks[h].tokens)
                out.append(tokens)
            return out

    def _chain(self, end: BlockHash) -> list[BlockHash]:
        """`end` and its ancestors, newest first."""
        chain: list[BlockHash] = []
        seen: set[BlockHash] = set()
        h: BlockHash | None = end
        while h is not None:
            block = self._blocks.get(h)
            if block is None:
                if h == end:
                    raise UnknownTokens(f"no tokens known for block {h!r}")
                raise UnknownTokens(
                    f"no tokens known for block {h!r}, an ancestor of block {end!r} (forgotten "
                    f"by the token index, or never reported with its tokens)"
                )
            if h in seen:  # a cycle can only come from bad input; never loop on it
                raise UnknownTokens(f"the chain of block {end!r} loops at block {h!r}")
            seen.add(h)
            chain.append(h)
            h = block.parent
        return chain


__all__ = ["TokenIndex", "UnknownTokens"]
