"""Pure geometry and planning: paged pools and window arenas, copy-train planning, BASE codecs
and the BASE pair view (``codecs``, ``pairs``).

Nothing here holds state or touches a device; the runtime builds on these.
"""

from kvops.layouts import codecs
from kvops.layouts.paged import (
    PagedGeometry,
    arena_as_pages,
    arena_page,
    page_bytes,
    pages_as_arena,
)
from kvops.layouts.pairs import base_pair_view
from kvops.layouts.trains import plan_trains

__all__ = ["PagedGeometry", "arena_as_pages", "arena_page", "base_pair_view", "codecs", "page_bytes",
           "pages_as_arena", "plan_trains"]
