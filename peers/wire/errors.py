"""How a peer refuses: ``RequestError`` (with the reason), and the refusals a client must tell apart: not admitted
(final), capacity (retry later or elsewhere, not a failure) and moved (the peer serves another span now: route
elsewhere, not a failure)."""

from __future__ import annotations

from privacy.errors import MembershipError


class RequestError(ValueError):
    """A peer refused a request; the message says why and what to change."""


NOT_ADMITTED = "not admitted"  # how a private swarm's peer refuses a non-member, or a revoked or expired one


class NotAdmittedError(MembershipError, RequestError):
    """A peer refused us as no member (no, expired or revoked certificate): final, every member answers the same
    until the swarm owner issues a new invite."""


CAPACITY_REFUSAL = "busy:"  # how a refusal for lack of capacity starts: retry later or elsewhere, not a failure


class CapacityError(RequestError):
    """A peer has no room for this request now (its cache, or this client's share of it, is full)."""


MOVED_REFUSAL = "moved:"  # how a peer that changed its span refuses work on its old one: re-route, not a failure


class MovedError(RequestError):
    """The peer no longer serves the blocks asked for (it moved to another span, or became a backup): it is healthy,
    so no ban; re-fetch the swarm's records and route (or replay) that span elsewhere."""


def moved_refusal(now: tuple[int, int] | None, before: tuple[int, int] | None, what: str = "") -> str:
    """The text of a ``MovedError``: what the peer serves now (None: nothing, a backup) and what it served (None:
    nothing, a peer that started as a backup)."""
    serves = f"now serves {now[0]}:{now[1]}" if now is not None else "is a backup and serves no blocks"
    served = f" (it served {before[0]}:{before[1]})" if before is not None else ""
    return (f"{MOVED_REFUSAL} this peer {serves}{served}{'; ' + what if what else ''}; refresh your view of the "
            f"swarm and route those blocks elsewhere")


def is_moved(error: BaseException) -> bool:
    """Whether ``error`` (a refusal, or a chain's report of a peer that refused) says a peer moved."""
    text = str(error)
    return isinstance(error, MovedError) or text.startswith(MOVED_REFUSAL) or f": {MOVED_REFUSAL}" in text



class ChainError(ConnectionError):
    """Chain: a peer could not hand its output to the next peer (``failed_peer``, which broke or refused it): a failure
    of that peer, not a refusal of this one; the client re-routes around ``failed_peer``."""

    def __init__(self, message: str, failed_peer: str) -> None:
        super().__init__(message)
        self.failed_peer = failed_peer


def refusal_or_failure(message: str, failed_peer: str = "") -> RequestError | ChainError:
    """A reply's error: the peer's own refusal, or (``failed_peer`` set) a failure further down the chain."""
    return ChainError(message, failed_peer) if failed_peer else RequestError(message)
