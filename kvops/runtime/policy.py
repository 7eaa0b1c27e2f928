"""The protocol every pager policy follows (transport, far view, fidelity, an engine's own).

A policy is attached to a pager before its first frame (:meth:`Pager.attach`) and declares:

- ``kind``: a short name (``"transport"``, ``"far_view"``, ``"fidelity"``); its stats appear
  under it in ``Commit.stats``.
- ``tables()``: ``{name: (shape, fill)}``, int32 tables it adds to the pager's one upload.
- ``sharing``: ``{other_kind: rule}``, which policies may share its pager. A rule is ``None``
  (compatible), a string (refused: the reason) or a function ``rule(self, other) -> str |
  None`` (refused when it returns a reason). Kinds it does not name are compatible. The pager
  checks both policies' declarations at every attach, whichever attached first.
- ``plan(frame, deltas, grown) -> Staged``: called once at commit, before anything is applied,
  with the frame's :class:`~kvops.runtime.frame.SessionDelta` list and its
  :class:`~kvops.runtime.frame.GrownBatch`. It reads the frame, writes its tables through
  :meth:`Frame.write` (or ``edit`` / ``scatter``), and returns its next host state without
  changing its current one.
- ``adopt(state)``: the pager calls it with the staged state once the commit is complete
  (tables written and uploaded). If the frame aborts instead, the staged state is dropped.

Device work a policy does inside a frame (a pack, a refine) is undone by the callbacks it
gives :meth:`Frame.on_abort`; :func:`run_all` runs every callback to the end even when one
raises, then raises the first error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple


class Staged(NamedTuple):
    """What :meth:`plan` returns: the host ``state`` to adopt at commit (``None``: nothing to
    adopt) and the ``stats`` the commit reports under the policy's kind."""

    state: object = None
    stats: dict | None = None


def run_all(fns: Iterable[Callable[[], object]]) -> None:
    """Call every ``fn()`` in order; if any raised, raise the first error after the last."""
    error = None
    for fn in fns:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - every callback runs; the first is raised
            if error is None:
                error = e
    if error is not None:
        raise error


def sharing_refusal(a, b) -> str | None:
    """Why policies ``a`` and ``b`` may not share a pager (from their ``sharing`` declarations,
    both ways), or ``None``."""
    for x, y in ((a, b), (b, a)):
        rule = getattr(x, "sharing", {}).get(getattr(y, "kind", None))
        if rule is None:
            continue
        reason = rule if isinstance(rule, str) else rule(x, y)
        if reason:
            return f"{type(x).__name__} and {type(y).__name__} on one pager: {reason}"
    return None
