"""A nesting limit on hivemind's msgpack ext types: without it, one small DHT message segfaults any node.

hivemind's ``MSGPackSerializer`` decodes an ext type (a tuple, a DHT dictionary) by calling msgpack again from
inside msgpack's C unpacker, and each such level costs about 45 KiB of C stack: a value of ~200 nested tuples
(about 1 KiB of msgpack) overflows the 8 MiB stack and the process dies of SIGSEGV, not of an exception. Every
DHT node decodes the values and subkeys that any peer sends it (a store, or a reply to a find), before any
validator sees them. ``install()`` makes the decoder raise ``ValueError`` past ``MAX_EXT_DEPTH`` levels instead,
which hivemind treats as a malformed message from that peer.
"""

from __future__ import annotations

import threading

from hivemind.utils.serializer import MSGPackSerializer

MAX_EXT_DEPTH = 16  # hivemind's own values nest 2 or 3 ext levels (a dictionary of tuples)
_depth = threading.local()


def install() -> None:
    """Guard ``MSGPackSerializer``'s ext decoder (idempotent); ``swarm.discovery.start_node`` calls it."""
    decode = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
    if getattr(decode, "depth_guarded", False):
        return

    def guarded(cls, type_code: int, data: bytes):
        depth = getattr(_depth, "level", 0)
        if depth >= MAX_EXT_DEPTH:
            raise ValueError(f"msgpack ext types nested more than {MAX_EXT_DEPTH} levels deep")
        _depth.level = depth + 1
        try:
            return decode(cls, type_code, data)
        finally:
            _depth.level = depth

    guarded.depth_guarded = True
    MSGPackSerializer._decode_ext_types = classmethod(guarded)
