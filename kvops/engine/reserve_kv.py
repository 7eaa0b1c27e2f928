"""``reserve``: the ``paged`` configuration with worst-case reservation at admission (a
request is admitted only when the pool can hold its whole context, prompt plus every output
token, so it never preempts). Pages are still mapped as the request grows; the pages it will
take later are held back from admission (``free_pages`` is the pager's free pages less every
running request's outstanding reservation), so a growth always finds its page.
"""

from __future__ import annotations

from kvops.engine.kv import PagedKV, _blocks
from kvops.engine.request import Request


class ReserveKV(PagedKV):
    def __init__(self, **kw):
        super().__init__(**kw)
        if self.window:
            raise ValueError(f"window: the reserve configuration has no window arenas, got "
                             f"{self.window}")
        self._outstanding: dict[str, int] = {}     # session -> pages reserved, not yet mapped
        self._taking: list[tuple[str, int]] = []

    def free_pages(self) -> int:
        return self.pager.free_pages - sum(self._outstanding.values())

    def _worst(self, req: Request, hit: int) -> int:
        """Pages ``req`` maps at most from admission (``hit`` aliased tokens): every block of
        its whole context not aliased, and a copy of a shared partly filled tail."""
        return _blocks(req.max_tokens, self.S) - hit // self.S + (1 if hit % self.S else 0)

    def pages_for(self, req: Request, n: int, hit: int = 0) -> int:
        if req.status.name == "RUNNING" and req.key in self._outstanding:
            return 0                                # reserved at admission
        return self._worst(req, hit)

    def commit_step(self, admits, grows):
        take = []
        for req, _, hit, n in admits:
            take.append((req.key, self._worst(req, hit), super().pages_for(req, n, hit)))
        for req, n in grows:
            take.append((req.key, None, super().pages_for(req, n)))
        commit = super().commit_step(admits, grows)
        for key, worst, pages in take:
            left = (worst if worst is not None else self._outstanding.get(key, 0)) - pages
            self._outstanding[key] = max(left, 0)
        return commit

    def end(self, req: Request, keep_prefix: bool = False) -> None:
        self._outstanding.pop(req.key, None)
        super().end(req, keep_prefix)
