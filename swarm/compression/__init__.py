"""Compression of the tensors between stages (issue 14).

- ``codecs``: ``Codec`` (none, fp16, bf16, int8, topk), ``encode``/``decode`` of one ``runtime_pb2.Tensor`` and
  ``payload_bytes``, the bytes a codec puts on the wire.
"""

from swarm.compression.codecs import CODECS, NONE, Codec, Decoded, Encoded, decode, encode, payload_bytes

__all__ = ["CODECS", "NONE", "Codec", "Decoded", "Encoded", "decode", "encode", "payload_bytes"]
