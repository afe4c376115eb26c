"""PeerRecord: validation of every field, the wire format and its forward compatibility."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest

from swarm.records import MAX_LINKS, WIRE_VERSION, LinkRow, PeerRecord, PeerState

PEER_A = "12D3KooW" + "A" * 44
PEER_B = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def link(n: int = 0, **changes) -> LinkRow:
    fields = dict(peer_id="12D3KooW" + "BCDEFGHJKLMN"[n] * 44, bandwidth=95e6, rtt=0.0012, age=3.5, source="probe")
    fields.update(changes)
    return LinkRow(**fields)


def make(**changes) -> PeerRecord:
    fields = dict(peer_id=PEER_A, model="llama-tiny", start=0, end=4, state=PeerState.ONLINE, throughput=100.0)
    fields.update(changes)
    return PeerRecord(**fields)


def wire(**changes) -> dict:
    w = make().to_wire()
    w.update(changes)
    return w


@pytest.mark.parametrize(
    "record",
    [
        make(),
        make(peer_id=PEER_B, start=3, end=8, state=PeerState.JOINING, throughput=0.0),
        make(state=PeerState.BACKUP, device="cuda:1", dtype="bfloat16", public_name="alice's 4090"),
        make(state=PeerState.OFFLINE, dtype="float16", version="0.1.0", max_batch_size=16),
        make(addresses=("/ip4/1.2.3.4/tcp/31337/p2p/" + PEER_A, "/ip6/::1/tcp/5/p2p/" + PEER_A)),
        make(throughput=12, start=0, end=1),  # an int throughput is a number too
        make(forward_seconds=2.5e-5, backward_seconds=6e-5),
        make(links=(link(0),)),
        make(links=tuple(link(i, bandwidth=0.0 if i % 2 else 1e9 * i, source="passive") for i in range(MAX_LINKS))),
        make(links=(link(0, bandwidth=0, rtt=0, age=0),)),  # ints are numbers; 0 bandwidth: only the rtt known
    ],
)
def test_wire_round_trip(record):
    w = record.to_wire()
    assert w["state"] == record.state.value and isinstance(w["state"], str)
    assert w["addresses"] == list(record.addresses)
    assert w["wire"] == WIRE_VERSION
    assert PeerRecord.from_wire(w) == record
    # what the DHT really carries: msgpack bytes
    packed = msgpack.unpackb(msgpack.packb(w, use_bin_type=True), raw=False)
    assert PeerRecord.from_wire(packed) == record


def test_properties():
    record = make(start=2, end=7)
    assert record.num_blocks == 5
    assert record.span == "2:7"


@pytest.mark.parametrize(
    "changes",
    [
        # peer id: base58 only, 20..80 characters, nothing around it
        {"peer_id": ""},
        {"peer_id": "12D3KooW"},
        {"peer_id": "0" * 46},  # '0' is not base58
        {"peer_id": "12D3KooW" + "l" * 44},  # 'l' is not base58
        {"peer_id": PEER_A + "\n"},
        {"peer_id": " " + PEER_A},
        {"peer_id": "A" * 81},
        {"peer_id": 12345678901234567890123},
        {"peer_id": None},
        # model
        {"model": ""},
        {"model": "m" * 257},
        {"model": 7},
        # block range
        {"start": 2, "end": 2},
        {"start": 5, "end": 2},
        {"start": -1, "end": 2},
        {"start": 0.0, "end": 2},
        {"start": 0, "end": 2.0},
        {"start": "0", "end": 2},
        {"start": False, "end": 2},
        {"start": 0, "end": True},
        # throughput
        {"throughput": -1.0},
        {"throughput": -1e-9},
        {"throughput": math.nan},
        {"throughput": math.inf},
        {"throughput": -math.inf},
        {"throughput": True},
        {"throughput": "100"},
        {"throughput": None},
        # state must be the enum when built directly
        {"state": "online"},
        {"state": None},
        # dtype
        {"dtype": "float64"},
        {"dtype": "int8"},
        {"dtype": ""},
        {"dtype": None},
        # free text fields
        {"device": 0},
        {"public_name": "x" * 257},
        {"version": None},
        # addresses
        {"addresses": ["/ip4/1.2.3.4/tcp/1"]},  # a list, not a tuple
        {"addresses": ("/ip4/1.2.3.4/tcp/1", 5)},
        {"addresses": (None,)},
        # measured compute (seconds per token per block)
        {"forward_seconds": -1e-6},
        {"forward_seconds": math.nan},
        {"forward_seconds": math.inf},
        {"forward_seconds": 3601.0},
        {"backward_seconds": "0.1"},
        {"backward_seconds": None},
        {"backward_seconds": True},
        # links: a tuple of at most MAX_LINKS LinkRow, one per neighbour
        {"links": [link(0)]},  # a list, not a tuple
        {"links": (link(0), {"peer": "x"})},
        {"links": tuple(link(i) for i in range(MAX_LINKS + 1))},
        {"links": (link(0), link(0, rtt=0.5))},  # the same neighbour twice
        # batch size
        {"max_batch_size": 0},
        {"max_batch_size": -3},
        {"max_batch_size": 2.0},
        {"max_batch_size": True},
    ],
    ids=repr,
)
def test_invalid_field_raises(changes):
    with pytest.raises(ValueError, match="invalid PeerRecord"):
        make(**changes)


@pytest.mark.parametrize(
    "value, match",
    [
        ([], "must be a dict"),
        ("record", "must be a dict"),
        (None, "must be a dict"),
        (42, "must be a dict"),
        (b"\x81", "must be a dict"),
        ((("peer_id", PEER_A),), "must be a dict"),
    ],
)
def test_from_wire_refuses_non_dict(value, match):
    with pytest.raises(ValueError, match=match):
        PeerRecord.from_wire(value)


@pytest.mark.parametrize("key", ["peer_id", "model", "start", "end", "state", "throughput"])
def test_from_wire_missing_key(key):
    w = wire()
    del w[key]
    with pytest.raises(ValueError, match=f"lacks \\['{key}'\\]"):
        PeerRecord.from_wire(w)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"state": "paused"}, "bad state 'paused'"),
        ({"state": "ONLINE"}, "bad state"),
        ({"state": None}, "bad state"),
        ({"state": 1}, "bad state"),
        ({"state": ["online"]}, "bad state"),
        ({"throughput": -5.0}, "bad throughput"),
        ({"throughput": math.nan}, "bad throughput"),
        ({"throughput": math.inf}, "bad throughput"),
        ({"throughput": False}, "bad throughput"),
        ({"start": True}, "start/end must be integers"),
        ({"end": 1.5}, "start/end must be integers"),
        ({"start": 4, "end": 4}, "bad block range 4:4"),
        ({"peer_id": "not a peer id"}, "bad peer_id"),
        ({"model": ""}, "bad model name"),
        ({"dtype": "float64"}, "bad dtype 'float64'"),
        ({"max_batch_size": 0}, "bad max_batch_size"),
        ({"addresses": [1, 2]}, "addresses must be strings"),
        ({"addresses": ["/ip4/1.2.3.4/tcp/1", None]}, "addresses must be strings"),
        ({"addresses": "/ip4/1.2.3.4/tcp/1"}, "addresses must be a list"),  # must not be split into characters
        ({"addresses": 5}, "addresses must be a list"),
        ({"addresses": {"/ip4/1.2.3.4/tcp/1": 1}}, "addresses must be a list"),
        ({"forward_seconds": -0.5}, "bad forward_seconds"),
        ({"backward_seconds": math.nan}, "bad backward_seconds"),
        ({"backward_seconds": [1.0]}, "bad backward_seconds of type list"),
        ({"links": "12D3KooW"}, "links must be a list"),
        ({"links": {"peer": 1}}, "links must be a list"),
        ({"links": [link().to_wire()] * (MAX_LINKS + 1)}, "9 links, at most 8"),
        ({"links": [[1, 2, 3, 4]]}, "a link must be a dict"),
        ({"links": [None]}, "a link must be a dict"),
        ({"links": [{"peer": link().peer_id, "bw": 1.0, "rtt": 1.0}]}, r"a link lacks \['age'\]"),
        ({"links": [{**link().to_wire(), "peer": "nope"}]}, "bad link peer_id 'nope'"),
        ({"links": [{**link().to_wire(), "peer": ["x"] * 10}]}, "bad link peer_id of type list"),
        ({"links": [{**link().to_wire(), "bw": -1.0}]}, "bad link bandwidth"),
        ({"links": [{**link().to_wire(), "bw": 1e14}]}, "bad link bandwidth"),
        ({"links": [{**link().to_wire(), "bw": math.inf}]}, "bad link bandwidth"),
        ({"links": [{**link().to_wire(), "rtt": math.nan}]}, "bad link rtt"),
        ({"links": [{**link().to_wire(), "rtt": 601.0}]}, "bad link rtt"),
        ({"links": [{**link().to_wire(), "rtt": "1"}]}, "bad link rtt"),
        ({"links": [{**link().to_wire(), "age": -1}]}, "bad link age"),
        ({"links": [{**link().to_wire(), "age": False}]}, "bad link age"),
        ({"links": [{**link().to_wire(), "src": "rumour"}]}, "bad link source 'rumour'"),
        ({"links": [{**link().to_wire(), "src": None}]}, "bad link source"),
        ({"links": [link(0).to_wire(), link(0).to_wire()]}, "links name a neighbour twice"),
    ],
    ids=repr,
)
def test_from_wire_invalid_field(changes, match):
    with pytest.raises(ValueError, match=match):
        PeerRecord.from_wire(wire(**changes))


@pytest.mark.parametrize(
    "extra",
    [
        {"gpu_memory": 24e9},
        {"disk_tokens": 4096, "regions": ["eu", "us"]},  # (cache_tokens is a field now)
        {"nested": {"a": [1, 2, {"b": None}]}},
    ],
)
def test_from_wire_ignores_unknown_fields(extra):
    """Newer peers may add fields; older ones must still read their records."""
    record = PeerRecord.from_wire({**wire(), **extra})
    assert record == make()
    assert not set(extra) & set(record.to_wire())


def test_from_wire_fills_optional_fields_with_defaults():
    minimal = {"peer_id": PEER_A, "model": "m", "start": 1, "end": 3, "state": "backup", "throughput": 2.5}
    record = PeerRecord.from_wire(minimal)
    defaults = {f.name: f.default for f in dataclasses.fields(PeerRecord) if f.default is not dataclasses.MISSING}
    assert record.state is PeerState.BACKUP
    assert (record.start, record.end, record.throughput) == (1, 3, 2.5)
    assert record.addresses == ()
    assert record.device == defaults["device"] == "cpu"
    assert record.dtype == defaults["dtype"] == "float32"
    assert record.max_batch_size == 1
    assert record.wire == WIRE_VERSION
    assert (record.forward_seconds, record.backward_seconds, record.links) == (0.0, 0.0, ())  # an older peer's


@pytest.mark.parametrize(
    "row",
    [
        {**link().to_wire(), "jitter": 0.1},  # newer fields of a row are ignored
        {key: value for key, value in link().to_wire().items() if key != "src"},  # no source: passive
    ],
)
def test_link_rows_are_forward_compatible(row):
    parsed = PeerRecord.from_wire(wire(links=[row])).links[0]
    assert (parsed.peer_id, parsed.bandwidth, parsed.rtt, parsed.age) == (link().peer_id, 95e6, 0.0012, 3.5)
    assert parsed.source == row.get("src", "passive")


@pytest.mark.parametrize(
    "changes, forward, backward",
    [
        ({"throughput": 200.0}, 0.005, 0.01),  # an older peer: from its throughput, backward 2x
        ({"throughput": 200.0, "forward_seconds": 0.001}, 0.001, 0.002),
        ({"throughput": 200.0, "forward_seconds": 0.001, "backward_seconds": 0.003}, 0.001, 0.003),
        ({"throughput": 0.0}, 0.01, 0.02),  # nothing known: a slow CPU
    ],
)
def test_compute_per_block_with_conservative_defaults(changes, forward, backward):
    record = make(**changes)
    assert record.seconds_per_block == pytest.approx(forward)
    assert record.backward_seconds_per_block == pytest.approx(backward)


def test_record_is_frozen():
    record = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.start = 1  # type: ignore[misc]
