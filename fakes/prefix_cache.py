"""The engine model's prefix cache: prompts hashed in fixed blocks, each hash chained to
the one before (:func:`block_hashes`), and the KV pool's blocks by hash with their users
counted and least-recently-used order for eviction (:class:`PrefixCache`)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence


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

    def evict(self, blocks: int) -> int:
        """Evict up to ``blocks`` unused blocks, least recently used first."""
        evicted = 0
        while evicted < blocks and self._free:
            block, _ = self._free.popitem(last=False)
            del self._users[block]
            evicted += 1
        return evicted
