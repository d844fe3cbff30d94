"""The engine model's prefix cache: prompts hashed in fixed blocks, each hash chained to
the one before (:func:`block_hashes`), and the KV pool's blocks by hash with their users
counted and least-recently-used order for eviction (:class:`PrefixCache`); with SGLang's
``--enable-session-radix-cache``, blocks referenced by open sessions (:class:`SessionRefs`)
are evicted after every unreferenced one."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# SGLang's session_ref_tracker.py: how many closed session ids are remembered, so that a
# request finishing after its session's close does not tag it again.
CLOSED_SESSION_TOMBSTONES = 8192


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """Chained hashes of the text's full blocks: equal lists mean equal prefixes."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start : start + block_chars].encode(), digest_size=12).digest()
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Blocks in the KV pool by hash, with users counted and LRU order for eviction.

    A block is in ``_free`` (ordered oldest first) exactly when no running request
    uses it, so eviction takes from the front and never touches a used block.
    """

    def __init__(self) -> None:
        self._users: dict[bytes, int] = {}
        self._free: OrderedDict[bytes, None] = OrderedDict()
        self._session_refs: dict[bytes, int] = {}  # open sessions covering a block (SessionRefs); empty without

    def __len__(self) -> int:
        return len(self._users)

    @property
    def evictable(self) -> int:
        return len(self._free)

    def __contains__(self, block: bytes) -> bool:
        return block in self._users

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks are present."""
        for count, block in enumerate(hashes):
            if block not in self._users:
                return count
        return len(hashes)

    def acquire(self, hashes: Iterable[bytes]) -> int:
        """Mark blocks used (adding missing ones); returns how many were added."""
        added = 0
        for block in hashes:
            users = self._users.get(block)
            if users is None:
                added += 1
                self._users[block] = 1
            else:
                self._users[block] = users + 1
                self._free.pop(block, None)
        return added

    def release(self, hashes: Iterable[bytes]) -> None:
        """Drop one use of each block; unused blocks become evictable, newest last.

        Released in reverse so a prompt's later blocks are older in LRU order than its
        first ones: the tail of a prefix goes before its head, as in a radix tree.
        """
        for block in reversed(list(hashes)):
            users = self._users.get(block)
            if users is None:
                continue
            if users <= 1:
                self._users[block] = 0
                self._free[block] = None
                self._free.move_to_end(block)
            else:
                self._users[block] = users - 1

    def session_refs(self, block: bytes) -> int:
        return self._session_refs.get(block, 0)

    def reference(self, blocks: Iterable[bytes]) -> None:
        """One more open session covers each of ``blocks`` (:class:`SessionRefs`)."""
        for block in blocks:
            self._session_refs[block] = self._session_refs.get(block, 0) + 1

    def dereference(self, blocks: Iterable[bytes]) -> None:
        for block in blocks:
            refs = self._session_refs.get(block, 0) - 1
            if refs > 0:
                self._session_refs[block] = refs
            else:
                self._session_refs.pop(block, None)

    def evict(self, blocks: int) -> int:
        """Evict up to ``blocks`` unused blocks, least recently used first (blocks open
        sessions reference last: :meth:`_evict_sessions_last`)."""
        if self._session_refs:
            return self._evict_sessions_last(blocks)
        evicted = 0
        while evicted < blocks and self._free:
            block, _ = self._free.popitem(last=False)
            del self._users[block]
            evicted += 1
        return evicted

    def _evict_sessions_last(self, blocks: int) -> int:
        """SGLang's session-aware eviction (``FullComponent._session_ref_eviction_strategy``,
        see :class:`SessionRefs`): the eviction order is ``(referenced, references, LRU)``,
        so every unreferenced block goes (least recently used first) before any block an
        open session references, and among those the fewer references go first."""
        order = [block for block in self._free if block not in self._session_refs]
        if len(order) < blocks:  # a stable sort keeps LRU order among equal counts
            order += sorted((block for block in self._free if block in self._session_refs),
                            key=self._session_refs.__getitem__)
        for block in order[:blocks]:
            del self._free[block]
            del self._users[block]
        return min(blocks, len(order))


class SessionRefs:
    """SGLang's session-aware radix cache (``--enable-session-radix-cache``): KV tagged by
    the request's top-level ``session_id``, kept ahead of unreferenced KV under eviction,
    and released in bulk by ``POST /close_session``.

    Read in SGLang, https://github.com/sgl-project/sglang: the feature
    (https://github.com/sgl-project/sglang/pull/27058, "session radix cache"), its
    reference-counting rewrite (https://github.com/sgl-project/sglang/pull/29173,
    "Session-reference-aware Unified Radix Cache for agentic multi-turn workloads") and the
    top-level ``session_id`` (https://github.com/sgl-project/sglang/pull/29436,
    "first-class session identity in SGLang"); the files:

    - ``python/sglang/srt/server_args.py``, ``enable_session_radix_cache``: "Track
      per-session references on UnifiedRadixCache KV: eviction consumes unreferenced
      entries before referenced ones, and closing a session only dereferences its KV."
    - ``python/sglang/srt/mem_cache/unified_cache/session_ref_tracker.py``,
      ``UnifiedSessionRefTracker``: a session begins implicitly with its first request
      (``ensure_session_generation``: no ``/open_session`` needed); when a request
      finishes, ``register_session_ref`` tags the leaf its final insert (prompt and
      output) ended on, unless the session was closed or reopened since the request
      arrived (its generation); ``release_radix_session`` (close) drops the session's
      references and remembers the id (8192 tombstones), and a later request reopens it.
    - ``python/sglang/srt/mem_cache/unified_cache/components/full_component.py``: a tagged
      leaf adds one reference to every node from it up to the root, and eviction pops
      leaves by ``(session_ref > 0, session_ref, LRU priority)``.
    - ``python/sglang/srt/entrypoints/http_server.py``, ``close_session``:
      ``POST /close_session`` with ``{"session_id": ...}`` (``CloseSessionReqInput``),
      answered 200 with an empty body.

    Here a leaf's path is the chain of block hashes of the finished request's prompt and
    reply that is in the cache, and a session's references are the union of its leaves'
    paths, so a block counts each open session that covers it once (SGLang counts a prefix
    twice for a session that forked into two leaves; only the order among referenced blocks
    can differ). The KV stays evictable, so a session under pressure is still evicted, last.
    """

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self._generations: dict[str, int] = {}
        self._incarnations = 0
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._covered: dict[str, set[bytes]] = {}

    @property
    def open(self) -> int:
        return len(self._generations)

    @property
    def referenced_blocks(self) -> int:
        return len(self.cache._session_refs)

    def begin(self, session_id: str) -> int:
        """``ensure_session_generation``: the session's current generation, opening it (and
        forgetting a close) when it has none."""
        generation = self._generations.get(session_id)
        if generation is None:
            self._closed.pop(session_id, None)
            self._incarnations += 1
            generation = self._generations[session_id] = self._incarnations
        return generation

    def register(self, session_id: str, generation: int | None, path: Sequence[bytes]) -> None:
        """``register_session_ref``: a finished request's cached path joins its session's."""
        if session_id in self._closed or generation is None or self._generations.get(session_id) != generation:
            return
        covered = self._covered.setdefault(session_id, set())
        new = [block for block in path if block not in covered]
        covered.update(new)
        self.cache.reference(new)

    def close(self, session_id: str) -> int:
        """``release_radix_session``: drop the session's references (its KV stays cached,
        now unreferenced); returns how many blocks it covered."""
        if session_id in self._closed:
            return 0
        self._closed[session_id] = None
        self._closed.move_to_end(session_id)
        while len(self._closed) > CLOSED_SESSION_TOMBSTONES:
            self._closed.popitem(last=False)
        self._generations.pop(session_id, None)
        covered = self._covered.pop(session_id, set())
        self.cache.dereference(covered)
        return len(covered)
