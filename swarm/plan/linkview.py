"""The planner's view of the links: the measured ones, indexed once, and conservative defaults for the rest.

``swarm.links.link_between`` scans every record per call; a planner asks about many pairs, so ``LinkView`` indexes a
snapshot's links once (``O(1)`` per pair) and lists each peer's known neighbours, so grouping follows measured links
instead of pricing all ``n^2`` pairs. A pair nobody measured costs ``swarm.links``' defaults (10 Mbit/s, 50 ms).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from swarm.links import DEFAULT_BANDWIDTH, DEFAULT_RTT
from swarm.plan.types import LinkCost

DENSE_LIMIT = 300  # peers: a plain ``LinkCost`` callable is asked about every pair up to this many


class LinkView:
    """Directed links ``(a, b) -> (bandwidth bits/s, rtt s)``. ``view(a, b)`` (a ``LinkCost``): the measured
    ``a -> b``, else the measured ``b -> a`` (taken as symmetric), else ``default``. ``neighbours(a)``: the peers
    with a measured link to or from ``a``, sorted."""

    def __init__(self, links: Mapping[tuple[str, str], tuple[float, float]],
                 default: tuple[float, float] = (DEFAULT_BANDWIDTH, DEFAULT_RTT)) -> None:
        self.links: dict[tuple[str, str], tuple[float, float]] = {}
        near: dict[str, set[str]] = {}
        for (a, b), (bandwidth, rtt) in links.items():
            if a == b:
                continue
            if not (bandwidth > 0 and rtt >= 0):
                raise ValueError(f"link {a} -> {b}: bandwidth must be > 0 and rtt >= 0, got {bandwidth}, {rtt}")
            self.links[(a, b)] = (float(bandwidth), float(rtt))
            near.setdefault(a, set()).add(b)
            near.setdefault(b, set()).add(a)
        self.default = default
        self._near = {peer: tuple(sorted(others)) for peer, others in near.items()}

    def __call__(self, a: str, b: str) -> tuple[float, float]:
        found = self.links.get((a, b))
        if found is None:
            found = self.links.get((b, a), self.default)
        return found

    def known(self, a: str, b: str) -> bool:
        """Whether the link between ``a`` and ``b`` was measured (either direction)."""
        return (a, b) in self.links or (b, a) in self.links

    def neighbours(self, a: str) -> tuple[str, ...]:
        return self._near.get(a, ())

    def pairs(self) -> list[tuple[str, str]]:
        """Every measured pair once, ``(a, b)`` with ``a < b``, sorted."""
        return sorted({(a, b) if a < b else (b, a) for a, b in self.links})


def as_link_view(links: LinkView | LinkCost, peer_ids: Iterable[str]) -> LinkView:
    """``links`` as a ``LinkView``: itself, or a plain ``LinkCost`` asked about every ordered pair of ``peer_ids``
    (``ValueError`` beyond ``DENSE_LIMIT`` peers: build a ``LinkView`` of the known links instead)."""
    if isinstance(links, LinkView):
        return links
    ids = sorted(set(peer_ids))
    if len(ids) > DENSE_LIMIT:
        raise ValueError(f"{len(ids)} peers: a plain link function would be asked about {len(ids) ** 2} pairs; pass "
                         f"a LinkView of the measured links (swarm.plan.link_view_from_records)")
    return LinkView({(a, b): links(a, b) for a in ids for b in ids if a != b})
