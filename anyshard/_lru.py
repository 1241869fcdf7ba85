"""`LRU`: a bounded map that threads may share, for the caches a process keeps between calls."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``size`` entries; adding one more drops the least recently used. Every method
    holds one lock: a lookup, its move to the front and an insertion with its evictions are
    each one step that no other thread interleaves with.

    >>> cache = LRU[str, int](2)
    >>> cache.put("a", 1); cache.put("b", 2); cache.get("a"); cache.put("c", 3)
    1
    >>> cache.get("b"), cache.get("a"), cache.get("c"), len(cache)
    (None, 1, 3, 2)
    """

    def __init__(self, size: int):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"an LRU holds at least one entry, not {size!r}")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The entry of ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Add or replace the entry of ``key``, dropping the least recently used beyond
        ``size``."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries
