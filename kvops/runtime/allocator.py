"""The page allocator: free pages as maximal spans in size-partitioned free lists.

List ``b`` holds spans of ``2**b .. 2**(b+1) - 1`` pages; boundary tags (a span's start and
last page) make freeing a page coalesce with its neighbours in O(1). A session grows into the
page right after its last page when that page starts a free span; a new session takes the
middle of a span from the largest list, leaving room on both sides; any other request takes a
span from the smallest list whose spans all hold it. Sessions therefore stay physically
contiguous and the transport's trains long.
"""

from __future__ import annotations


class OutOfPages(MemoryError):
    """The pool cannot satisfy a reserve; raised before any mapping changes."""


class SpanAllocator:
    """Free pages as maximal spans in size-partitioned free lists; O(1) take and give."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = 0
        self._len_at: dict[int, int] = {}       # span start -> length
        self._start_of_last: dict[int, int] = {}  # span's last page -> start
        self._lists: list[dict[int, None]] = [{} for _ in range(max(1, num_pages.bit_length()))]
        self._insert(0, num_pages)

    def _insert(self, start: int, n: int) -> None:
        self._len_at[start] = n
        self._start_of_last[start + n - 1] = start
        self._lists[n.bit_length() - 1][start] = None
        self.free += n

    def _remove(self, start: int) -> int:
        n = self._len_at.pop(start)
        del self._start_of_last[start + n - 1]
        del self._lists[n.bit_length() - 1][start]
        self.free -= n
        return n

    def _take_from(self, start: int, offset: int, n: int) -> int:
        """Cut ``n`` pages at ``start + offset`` out of the free span at ``start``."""
        length = self._remove(start)
        if offset:
            self._insert(start, offset)
        rest = length - offset - n
        if rest:
            self._insert(start + offset + n, rest)
        return start + offset

    def take_at(self, page: int, n: int) -> int:
        """Take up to ``n`` pages starting exactly at ``page`` when a free span starts there.

        Returns how many were taken (0 when ``page`` does not start a free span).
        """
        length = self._len_at.get(page)
        if not length:
            return 0
        k = min(n, length)
        self._take_from(page, 0, k)
        return k

    def take(self, n: int, *, spread: bool = False) -> list[tuple[int, int]]:
        """Take ``n`` pages as few contiguous runs ``(start, count)`` as the free lists allow.

        ``spread`` (a new session): from the largest list, in the middle of the span, so the
        session and the one before the span can both grow in place.
        """
        if n > self.free:
            raise OutOfPages(f"pager: need {n} free pages, have {self.free} of {self.num_pages}")
        runs = []
        while n:
            fit = max(0, (n - 1).bit_length())        # spans in list >= fit hold n pages
            lists = self._lists
            pick = -1
            if spread:
                for b in range(len(lists) - 1, -1, -1):
                    if lists[b]:
                        pick = b
                        break
            else:
                for b in range(fit, len(lists)):
                    if lists[b]:
                        pick = b
                        break
                if pick < 0:                           # nothing holds n: the largest, in parts
                    for b in range(fit - 1, -1, -1):
                        if lists[b]:
                            pick = b
                            break
            start = next(iter(lists[pick]))
            length = self._len_at[start]
            k = min(n, length)
            offset = (length - k) // 2 if spread and start > 0 else 0
            runs.append((self._take_from(start, offset, k), k))
            n -= k
        return runs

    def give(self, page: int) -> None:
        """Return one page, merging it with free neighbours."""
        start, n = page, 1
        left = self._start_of_last.get(page - 1)
        if left is not None:
            n += self._remove(left)
            start = left
        if page + 1 in self._len_at:
            n += self._remove(page + 1)
        self._insert(start, n)

    def spans(self) -> list[tuple[int, int]]:
        """Free spans ``(start, length)`` sorted by start (for tests and stats)."""
        return sorted(self._len_at.items())
