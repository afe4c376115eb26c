"""How a peer refuses: ``RequestError`` (with the reason), and the refusals a client must tell apart: not admitted
(final) and capacity (retry later or elsewhere, not a failure)."""

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




class ChainError(ConnectionError):
    """Chain: a peer could not hand its output to the next peer (``failed_peer``, which broke or refused it): a failure
    of that peer, not a refusal of this one; the client re-routes around ``failed_peer``."""

    def __init__(self, message: str, failed_peer: str) -> None:
        super().__init__(message)
        self.failed_peer = failed_peer


def refusal_or_failure(message: str, failed_peer: str = "") -> RequestError | ChainError:
    """A reply's error: the peer's own refusal, or (``failed_peer`` set) a failure further down the chain."""
    return ChainError(message, failed_peer) if failed_peer else RequestError(message)
