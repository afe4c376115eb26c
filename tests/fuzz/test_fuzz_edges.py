"""Fuzz ``read_edge_messages`` (issue 18's multi-tensor cuts): bundles with mutated headers, dropped, repeated or
reordered messages, and receivers expecting other edges: only a ``RequestError`` (or the channel's refusal), never
another exception, and what is returned is exactly the expected edges."""

from __future__ import annotations

import asyncio

import torch
from fuzz_strategies import INTS, VALUES, pack
from hypothesis import given
from hypothesis import strategies as st

from peers.model.graph.trace import EdgeSpec
from peers.wire.edges import EdgeHeader, edge_messages, read_edge_messages
from peers.wire.errors import RequestError
from privacy.errors import ChannelError

RUN = asyncio.new_event_loop().run_until_complete
HASH = "0f" * 32
DTYPES = [torch.float32, torch.float16, torch.bool, torch.int64]


@st.composite
def specs(draw) -> tuple[EdgeSpec, ...]:
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "x"]), min_size=1, max_size=3, unique=True))
    return tuple(EdgeSpec(n, tuple(draw(st.lists(st.integers(0, 4), max_size=3))), draw(st.sampled_from(DTYPES)))
                 for n in names)


def _tensor(spec: EdgeSpec) -> torch.Tensor:
    return torch.zeros(spec.shape, dtype=spec.dtype)


headers = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda h, names, i, ctx: EdgeHeader(h, names, i, ctx).to_bytes(),
              st.sampled_from([HASH, "", "1" * 64]), st.lists(st.sampled_from(["a", "b", "c", "x", ""]), max_size=4),
              INTS, st.binary(max_size=8)),
    st.dictionaries(st.sampled_from(["graph_hash", "names", "index", "context"]), VALUES, max_size=4).map(pack),
)


@st.composite
def bundles(draw) -> tuple[list, tuple[EdgeSpec, ...]]:
    sent = draw(specs())
    messages = list(edge_messages({s.name: _tensor(s) for s in sent}, sent, HASH, context=b"ctx"))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(messages) - 1))
        kind = draw(st.sampled_from(["header", "drop", "repeat", "swap"]))
        if kind == "header":
            messages[i].metadata = draw(headers)
        elif kind == "drop" and len(messages) > 1:
            messages.pop(i)
        elif kind == "repeat":
            messages.insert(i, messages[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(messages) - 1))
            messages[i], messages[j] = messages[j], messages[i]
    expected = draw(st.just(sent) | specs())
    return messages, expected


@given(bundles(), st.integers(0, 400))
def test_read_edge_messages(bundle, max_bytes):
    messages, expected = bundle

    async def stream():
        for message in messages:
            yield message

    try:
        tensors, context = RUN(read_edge_messages(stream(), expected, HASH, max_bytes))
    except (RequestError, ChannelError):
        return
    assert list(tensors) == [s.name for s in expected] and context == b"ctx"
    for spec in expected:
        spec.check(tensors[spec.name])
