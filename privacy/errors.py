"""Exceptions of the privacy package: every message says what is wrong and what to do about it."""

from __future__ import annotations


class PrivacyError(ValueError):
    """Base class: a key file, certificate, proof or encrypted message was refused."""


class MembershipError(PrivacyError):
    """A certificate, revocation or membership proof is not acceptable for this swarm."""


class ChannelError(PrivacyError):
    """An encrypted channel's handshake or message was refused."""
