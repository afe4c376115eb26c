"""Link matrices: the rate of every ordered pair of hosts, and each host's access link. Pure.

A rate is in bits per second on the wire (Ethernet frames, as ``tc`` counts them); ``None`` means unshaped. The rate
from host ``i`` to host ``j`` is the smallest of the pair's own rate, ``i``'s upload and ``j``'s download.
Latency is not part of a matrix: this kernel has no ``netem`` (see ``swarm.testbed``'s docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Rate = float | None
PairRate = Callable[[int, int, int], Rate]  # (src, dst, number of hosts) -> bits/s
HostRate = Callable[[int, int], Rate]  # (host, number of hosts) -> bits/s
HostSite = Callable[[int, int], str]

KBIT, MBIT, GBIT = 1e3, 1e6, 1e9


def _none(*_: int) -> Rate:
    return None


def _one_site(_i: int, _n: int) -> str:
    return "lan"


@dataclass(frozen=True)
class Matrix:
    """How a testbed shapes its links: a per-pair rate, per-host upload/download and the host's site."""

    name: str
    description: str
    pair: PairRate = _none
    up: HostRate = _none
    down: HostRate = _none
    site: HostSite = field(default=_one_site)

    def rate(self, src: int, dst: int, n: int) -> float:
        """The bits/s from ``src`` to ``dst`` (``inf`` where nothing shapes the path)."""
        rates = [r for r in (self.pair(src, dst, n), self.up(src, n), self.down(dst, n)) if r is not None]
        return float(min(rates)) if rates else float("inf")


def three_sites_site(i: int, n: int) -> str:
    """Hosts split into 3 contiguous groups: site-a, site-b, site-c (fewer sites when n < 3)."""
    return "site-" + "abc"[min(2, i * 3 // max(n, 1))]


def _three_sites_pair(i: int, j: int, n: int) -> Rate:
    a, b = three_sites_site(i, n), three_sites_site(j, n)
    if a == b:
        return 10 * GBIT
    if "site-c" in (a, b):
        return 8 * MBIT
    return 100 * MBIT


MATRICES: dict[str, Matrix] = {
    "lan": Matrix("lan", "every pair 1 Gbit/s", pair=lambda i, j, n: 1 * GBIT),
    "three_sites": Matrix(
        "three_sites",
        "hosts split over 3 sites: 10 Gbit/s inside a site, 100 Mbit/s between site-a and site-b, "
        "8 Mbit/s between either of them and site-c",
        pair=_three_sites_pair, site=three_sites_site,
    ),
    "home": Matrix(
        "home", "home broadband: every host 50 Mbit/s down, 10 Mbit/s up",
        up=lambda i, n: 10 * MBIT, down=lambda i, n: 50 * MBIT, site=lambda i, n: f"home{i}",
    ),
}

MatrixLike = str | Matrix | Mapping[tuple[int, int], float] | Callable[[int, int], Rate] | None


def resolve_matrix(matrix: MatrixLike) -> Matrix:
    """A name of ``MATRICES``, a ``Matrix``, a dict ``{(src, dst): bits/s}`` (other pairs unshaped), a callable
    ``(src, dst) -> bits/s | None``, or ``None`` (nothing shaped)."""
    if matrix is None:
        return Matrix("unshaped", "no shaping")
    if isinstance(matrix, Matrix):
        return matrix
    if isinstance(matrix, str):
        if matrix not in MATRICES:
            raise ValueError(f"unknown matrix {matrix!r}: use one of {', '.join(MATRICES)} (or pass a dict/callable)")
        return MATRICES[matrix]
    if isinstance(matrix, Mapping):
        table = {(int(s), int(d)): float(r) for (s, d), r in matrix.items()}
        for (s, d), r in table.items():
            if s == d or s < 0 or d < 0 or not r > 0:
                raise ValueError(f"bad matrix entry ({s}, {d}): {r}: need two different hosts and a rate > 0 bits/s")
        return Matrix("custom", "custom pair rates", pair=lambda i, j, n: table.get((i, j)))
    if callable(matrix):
        func = matrix
        return Matrix("custom", "custom pair rates", pair=lambda i, j, n: func(i, j))
    raise TypeError(f"a matrix is a name, a Matrix, a dict or a callable, not {type(matrix).__name__}")


def rate_classes(matrix: Matrix, n: int) -> list[dict]:
    """One representative measurement per distinct configured rate of ``matrix`` on ``n`` hosts.

    Each is ``{"kind", "rate", "senders", "receiver"}``: kind ``pair`` is one host sending to another; kind
    ``download`` is every other host sending to one host at once, listed where their uploads together exceed that
    host's download (the only way a download limit shows when each upload is smaller than it).
    """
    found: dict[tuple[str, float], dict] = {}
    for i in range(n):
        for j in range(n):
            if i != j:
                rate = matrix.rate(i, j, n)
                found.setdefault(("pair", rate), {"kind": "pair", "rate": rate, "senders": [i], "receiver": j})
    for j in range(n):
        down = matrix.down(j, n)
        senders = [i for i in range(n) if i != j]
        if down is None or not senders:
            continue
        offered = sum(min(r for r in (matrix.pair(i, j, n), matrix.up(i, n)) if r is not None)
                      if any(r is not None for r in (matrix.pair(i, j, n), matrix.up(i, n))) else float("inf")
                      for i in senders)
        if offered > down and ("pair", float(down)) not in found:
            found.setdefault(("download", float(down)),
                             {"kind": "download", "rate": float(down), "senders": senders, "receiver": j})
    return sorted(found.values(), key=lambda c: (c["kind"], c["rate"]))
