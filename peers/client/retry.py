"""The one retry policy of a client, its inference sessions and the trainer.

A peer's refusal (``RequestError``) says why, so retrying it elsewhere is pointless, except a refusal for capacity
(``CapacityError``: the peer is busy, another one or a later try may take it; no ban) and a refusal of a peer that
moved to another span (``MovedError``: re-fetch the records and route elsewhere; no ban). Not being admitted
(``MembershipError``) and no route at all (``NoRouteError``) are final. Anything else (a broken stream, a missing
heartbeat, a deadline) is a failure: the peer is banned once per failure event (``swarm.routing.Router``) and the
request retried on another peer after ``backoff``, up to ``ClientConfig.max_retries`` times.
"""

from __future__ import annotations

from peers.wire.errors import (
    CAPACITY_REFUSAL,
    MOVED_REFUSAL,
    NOT_ADMITTED,
    CapacityError,
    MovedError,
    NotAdmittedError,
    RequestError,
    is_moved,
)
from privacy.errors import MembershipError
from swarm.routing import NoRouteError, Router

BACKOFF_BASE, BACKOFF_MAX = 0.05, 2.0  # seconds before retry k: min(BASE * 2**k, MAX)


def classify(error: RequestError) -> RequestError:
    """A peer's refusal as the subclass its message names: ``NotAdmittedError`` (final), ``CapacityError`` (the
    peer is busy: another peer or a retry soon may take it), else ``error`` itself."""
    text = str(error)
    for prefix, cls in ((NOT_ADMITTED, NotAdmittedError), (CAPACITY_REFUSAL, CapacityError),
                        (MOVED_REFUSAL, MovedError),
                        ("cache full", CapacityError)):  # "cache full": how older peers said it
        if (text.startswith(prefix) or f": {prefix}" in text) and not isinstance(error, cls):
            return cls(text)
    return error


def is_final(error: BaseException) -> bool:
    """Whether retrying ``error`` on another peer cannot help (a reasoned refusal, not admitted, no route)."""
    if isinstance(error, (CapacityError, MovedError)):
        return False
    return isinstance(error, (RequestError, MembershipError, NoRouteError))


def backoff(failures: int) -> float:
    """Seconds to wait before the retry after ``failures`` failures."""
    return min(BACKOFF_BASE * 2**failures, BACKOFF_MAX)


def report_failure(router: Router, peer_id: str, error: BaseException, span: tuple[int, int],
                   started: float | None = None) -> None:
    """A hop on ``span`` failed or was refused: a peer that moved off the span is routed around without a ban
    (``Router.on_moved``; it is healthy), any other failure bans it (``Router.on_failure``)."""
    if is_moved(error):
        router.on_moved(peer_id, span[0], span[1], error)
    else:
        router.on_failure(peer_id, error, started=started)
