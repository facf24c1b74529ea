"""One tier of one instance (its HBM, or its host DRAM): a fixed number of block slots.

Eviction follows LRU unless told otherwise, with the advice a policy can give in production
vocabulary: *pin with a time-to-live* (evicted only after every unadvised block) and *demote*
(evicted first). A policy that knows better can instead rank victims by a key (Belady's
next use, a model's predicted return); blocks of running requests and blocks still landing are
pinned and are never evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable

INF = float("inf")


class Entry:
    __slots__ = ("demoted", "keep_until", "pins", "prefetched", "used", "version")

    def __init__(self) -> None:
        self.pins = 0
        self.keep_until = -INF
        self.demoted = False
        # Landed by a prefetch and not yet used by a request.
        self.prefetched = False
        self.version = 0
        # When it was last used (a stamp from its cache's counter): its place in the LRU order.
        self.used = 0


class BlockCache:
    def __init__(
        self,
        capacity_blocks: int,
        *,
        evict_key: Callable[[int], float] | None = None,
        hard_keeps: bool = False,
    ) -> None:
        self.capacity = capacity_blocks
        # A keep holds like a pin until its end (never evicted for room), not only last in line.
        self.hard_keeps = hard_keeps
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.evict_key = evict_key
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = itertools.count()
        # The demoted blocks: a victim search takes them first without scanning the whole cache
        # for the flag (a demoted block is not used, or it would no longer be demoted, so its
        # place in the LRU order is its `used` stamp).
        self._demoted: dict[int, None] = {}
        self._uses = itertools.count()

    def __contains__(self, block: int) -> bool:
        return block in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def free(self) -> int:
        return self.capacity - len(self.entries)

    @property
    def demoted(self) -> int:
        """Blocks advised out: evicted before anything else."""
        return len(self._demoted)

    def insert(self, block: int) -> Entry:
        """Take a slot (the caller made room); the block is most recently used."""
        entry = self.entries.get(block)
        if entry is None:
            entry = self.entries[block] = Entry()
        self.touch(block)
        return entry

    def touch(self, block: int) -> None:
        """The block was used: most recently used, and no longer demoted (a demotion is advice
        about one session's context; a use, by any session, outranks it)."""
        entry = self.entries[block]
        if entry.demoted:
            entry.demoted = False
            del self._demoted[block]
        entry.used = next(self._uses)
        self.entries.move_to_end(block)
        if self.evict_key is not None:
            self._rank(block, self.entries[block])

    def demote(self, block: int) -> None:
        """Advice: evict this block first (and no longer keep it)."""
        entry = self.entries.get(block)
        if entry is not None:
            entry.keep_until = -1.0
            if not entry.demoted:
                entry.demoted = True
                self._demoted[block] = None

    def keep(self, block: int, until: float) -> None:
        """Advice: evict this block only after every unadvised one, until `until`."""
        entry = self.entries.get(block)
        if entry is not None:
            entry.keep_until = max(entry.keep_until, until)
            if entry.demoted:
                entry.demoted = False
                del self._demoted[block]

    def unkeep(self, block: int) -> None:
        """A keep withdrawn: the block goes in plain LRU order again."""
        entry = self.entries.get(block)
        if entry is not None:
            entry.keep_until = -INF

    def undemote(self, block: int) -> None:
        """A demotion withdrawn: the block goes back to its place in LRU order (its last use)."""
        entry = self.entries.get(block)
        if entry is not None and entry.demoted:
            entry.demoted = False
            del self._demoted[block]

    def is_demoted(self, block: int) -> bool:
        entry = self.entries.get(block)
        return entry is not None and entry.demoted

    def clear_advice(self) -> None:
        """Every keep and demotion lapses at once: plain LRU from here on."""
        for entry in self.entries.values():
            entry.keep_until = -INF
            entry.demoted = False
        self._demoted.clear()

    def rekey(self, block: int) -> None:
        """The eviction key of a resident block changed: rank it by the new one (LRU order kept)."""
        entry = self.entries.get(block)
        if entry is not None and self.evict_key is not None:
            self._rank(block, entry)

    def _rank(self, block: int, entry: Entry) -> None:
        # Versions come from one counter, never per entry: a block evicted and inserted again
        # must not match a ranking left over from its earlier stay.
        seq = next(self._seq)
        entry.version = seq
        heapq.heappush(self._heap, (-self.evict_key(block), seq, block, seq))  # type: ignore[misc]

    def unpin(self, block: int) -> None:
        """Drop one pin; a block that becomes evictable is ranked again (victim searches drop
        pinned blocks from the ranking rather than cycling past them on every search)."""
        e = self.entries.get(block)
        if e is not None:
            e.pins -= 1
            if e.pins == 0 and self.evict_key is not None:
                self._rank(block, e)

    def remove(self, block: int) -> Entry | None:
        self._demoted.pop(block, None)
        return self.entries.pop(block, None)

    def evictable(self, block: int) -> bool:
        e = self.entries.get(block)
        return e is not None and e.pins == 0

    def choose_victims(
        self, n: int, now: float, exclude: set[int] | frozenset[int] = frozenset()
    ) -> list[int] | None:
        """n blocks to evict, in order, or None when pinned blocks leave too little room.

        Blocks in `exclude` (those the caller is about to use) are never chosen.
        """
        if n <= 0:
            return []
        if self.evict_key is not None:
            return self._victims_by_key(n, exclude)
        entries = self.entries
        demoted = sorted(
            (b for b in self._demoted if entries[b].pins == 0 and b not in exclude),
            key=lambda b: entries[b].used,
        )
        victims = demoted[:n]  # demoted first, in LRU order
        if len(victims) == n:
            return victims
        # Then LRU, blocks kept by advice last: one pass, stopped once n unadvised are found.
        want = n - len(victims)
        kept: list[int] = []
        for block, e in entries.items():
            if e.pins or e.demoted or block in exclude:
                continue
            if e.keep_until > now:
                if len(kept) < want:
                    kept.append(block)
                continue
            victims.append(block)
            want -= 1
            if want == 0:
                return victims
        if len(kept) < want or self.hard_keeps:
            return None
        victims.extend(kept[:want])
        return victims

    def _victims_by_key(self, n: int, exclude: set[int] | frozenset[int]) -> list[int] | None:
        victims: list[int] = []
        skipped: list[tuple[float, int, int, int]] = []
        chosen: set[int] = set()
        while self._heap and len(victims) < n:
            item = heapq.heappop(self._heap)
            _, _, block, version = item
            e = self.entries.get(block)
            if e is None or e.version != version or block in chosen:
                continue  # stale
            if e.pins:
                continue  # ranked again by unpin()
            if block in exclude:
                skipped.append(item)
                continue
            victims.append(block)
            chosen.add(block)
        for item in skipped:
            heapq.heappush(self._heap, item)
        for block in victims:  # a query only: the caller removes the victims, or not
            self._rank(block, self.entries[block])
        if len(victims) < n:
            return None  # not enough room
        return victims

    def pinned_blocks(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)
