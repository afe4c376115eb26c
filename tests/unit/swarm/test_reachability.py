"""The reachability check's pure parts (table tests) and its service on real daemons on 127.0.0.1: bounds,
bad input refused while the helper keeps answering, and the dial-back itself."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from swarm.discovery import StartupRefused, start_node, visible_maddrs
from swarm.nat import NatOptions
from swarm.reachability import (
    HANDLE,
    MAX_ADDRS,
    CheckAnswer,
    CheckRequest,
    Dial,
    RateLimiter,
    Reachability,
    _receive,
    _send,
    ask,
    check_reachability,
    dialable,
    maddr_bytes,
    peer_ids_of,
    unreachable_message,
)

ME = "12D3KooWFpbssVJyMjAxR1t8g32zQT7sprY1LGoWNqXvreHNTk9z"
OTHER = "12D3KooWPJSttMs9APeuDeaWqMsQE3ehgu2Sdey7BcWPgFBSB3zZ"
SEEN = "/ip4/1.2.3.4/tcp/5555"


@pytest.mark.parametrize(("addr", "dialled", "why"), [
    ("/ip4/1.2.3.4/tcp/31337", "/ip4/1.2.3.4/tcp/31337", None),
    (f"/ip4/1.2.3.4/tcp/31337/p2p/{ME}", "/ip4/1.2.3.4/tcp/31337", None),  # our own id: stripped
    ("/ip4/1.2.3.4/udp/31337/quic-v1", "/ip4/1.2.3.4/udp/31337/quic-v1", None),
    ("/ip4/5.6.7.8/tcp/31337", None, "not the IP you connect from (1.2.3.4)"),  # someone else's machine
    ("/ip4/10.0.0.2/tcp/31337", None, "not the IP you connect from"),  # a LAN address behind NAT
    (f"/ip4/1.2.3.4/tcp/31337/p2p/{OTHER}", None, "names another peer id"),
    (f"/ip4/1.2.3.4/tcp/31337/p2p/{OTHER}/p2p-circuit", None, "a relayed address"),
    ("/dns4/example.org/tcp/31337", None, "not an /ip4|ip6/ADDRESS/tcp|udp/PORT address"),
    ("/ip4/1.2.3.4/tcp/0", None, "no valid port"),
    ("/ip4/1.2.3.4/tcp/70000", None, "no valid port"),
    ("/ip4/1.2.3.4/tcp/x", None, "no valid port"),
    ("not a multiaddr", None, "not an /ip4"),
    ("/ip4/1.2.3.4", None, "not an /ip4"),
])
def test_dialable_only_the_callers_own_ip_and_peer_id(addr, dialled, why):
    dial, skipped = dialable([addr], SEEN, ME)
    assert dial == ([dialled] if dialled else [])
    if why:
        assert len(skipped) == 1 and why in skipped[0][1]


def test_dialable_caps_the_addresses_and_drops_repeats():
    addrs = [f"/ip4/1.2.3.4/tcp/{1000 + i}" for i in range(3 * MAX_ADDRS)]
    dial, _ = dialable(addrs + addrs, SEEN, ME)
    assert dial == addrs[:MAX_ADDRS]


def test_rate_limiter_per_caller_and_in_all():
    now = [0.0]
    limiter = RateLimiter(per_key=2, total=3, window=60.0, clock=lambda: now[0])
    assert limiter.allow("a") is None and limiter.allow("a") is None
    assert "per caller" in limiter.allow("a")
    assert limiter.allow("b") is None
    assert "at most 3" in limiter.allow("c")  # the helper's own limit
    now[0] = 61.0  # the window slid past
    assert limiter.allow("a") is None and limiter.allow("c") is None


@pytest.mark.parametrize(("raw", "error"), [
    (b"\xc1", "not a msgpack message"),
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"addrs": "x"}), "addrs must be a list"),
    (msgpack.packb({"addrs": [1]}), "addrs must be a list"),
    (msgpack.packb({"addrs": ["/ip4/" + "1" * 300]}), "at most 256"),
    (msgpack.packb({"addrs": ["/ip4/1.2.3.4/tcp/1"] * 40}), "at most 32 addresses"),
    (msgpack.packb({"addrs": [], "relayed": 1}), "relayed must be"),
    (msgpack.packb({b"addrs": []}), "not a msgpack message"),  # bytes keys
    (msgpack.packb({"addrs": [b"\x00"]}), "not a msgpack message"),  # bin values
    (b"\x00" * 5000, "exceeds 4096"),
])
def test_bad_requests_are_refused_with_a_reason(raw, error):
    with pytest.raises(ValueError, match=error):
        CheckRequest.from_bytes(raw)


def test_messages_round_trip():
    request = CheckRequest(("/ip4/1.2.3.4/tcp/1",), relayed=True)
    assert CheckRequest.from_bytes(request.to_bytes()) == request
    answer = CheckAnswer(observed=SEEN, direct=Dial(False, error="refused"), skipped=(("/x", "why"),),
                         relayed=Dial(True, addr="/ip4/1.2.3.4/tcp/1/p2p-circuit"))
    assert CheckAnswer.from_bytes(answer.to_bytes(), helper=ME) == CheckAnswer(helper=ME, **{
        k: getattr(answer, k) for k in ("observed", "direct", "skipped", "relayed", "refused")})


@pytest.mark.parametrize("wire", [{"direct": {"ok": "yes"}}, {"skipped": [["a"]]}, {"observed": 5},
                                  {"relayed": {"ok": True, "addr": 5}}])
def test_bad_answers_raise(wire):
    with pytest.raises(ValueError):
        CheckAnswer.from_bytes(msgpack.packb(wire), helper=ME)


def _answer(ok: bool | None, relayed: bool | None = None) -> CheckAnswer:
    return CheckAnswer(observed=SEEN, direct=None if ok is None else Dial(ok),
                       relayed=None if relayed is None else Dial(relayed))


@pytest.mark.parametrize(("answers", "direct"), [
    ([], None),
    ([_answer(None)], None),  # refused or not asked: nobody could check
    ([_answer(True)], True),
    ([_answer(False)], False),
    ([_answer(True), _answer(False)], True),  # half is enough
    ([_answer(True), _answer(False), _answer(False)], False),
    ([_answer(True), _answer(True), _answer(False)], True),
])
def test_the_direct_verdict_is_a_majority_of_answers(answers, direct):
    assert Reachability((), answers).direct is direct


def test_the_relayed_verdict_needs_one_relay():
    assert Reachability((), [_answer(None, False), _answer(None, True)]).relayed is True
    assert Reachability((), [_answer(None, False)]).relayed is False
    assert Reachability((), [_answer(True)]).relayed is None


def test_peer_ids_of_initial_peers():
    assert peer_ids_of([f"/ip4/1.2.3.4/tcp/1/p2p/{ME}", f"/ip4/5.6.7.8/tcp/1/p2p/{ME}", f"/ip4/1/tcp/2/p2p/{OTHER}",
                        f"/ip4/1.2.3.4/tcp/1/p2p/{OTHER}/p2p-circuit/p2p/{ME}"]) == [ME, OTHER]


def test_maddr_bytes_writes_peer_ids_as_bare_multihashes():
    digest = PeerID.from_base58(ME).to_bytes()
    raw = maddr_bytes(f"/ip4/127.0.0.1/tcp/39653/p2p/{ME}/p2p-circuit")
    assert raw == bytes.fromhex("047f000001069ae5") + b"\xa5\x03" + bytes([len(digest)]) + digest + b"\xa2\x02"


def test_the_unreachable_message_says_what_to_do():
    report = Reachability(("/ip4/10.0.0.2/tcp/31337",), [CheckAnswer(
        helper=ME, observed=SEEN, direct=Dial(False, error="no address to dial"),
        skipped=(("/ip4/10.0.0.2/tcp/31337", "not the IP you connect from (1.2.3.4)"),))])
    text = unreachable_message(report)
    assert "not reachable" in text and "not the IP you connect from" in text
    assert "drop --no_relay / --no_auto_relay" in text
    assert "--announce_maddrs /ip4/1.2.3.4/tcp/PORT" in text  # the public IP the helper saw
    assert "--force_reachability public" in text


# ---- the service on real daemons ------------------------------------------------------------------------------

def _two_nodes(body):
    async def main():
        helper = await start_node()
        asker = await start_node(initial_peers=await visible_maddrs(helper), client_mode=True)
        try:
            return await asyncio.wait_for(body(helper, asker), 60)
        finally:
            await asyncio.gather(asker.shutdown(), helper.shutdown(), return_exceptions=True)

    return asyncio.run(main())


def test_a_helper_dials_back_a_listening_peer_and_not_a_dead_address():
    async def body(helper, asker):
        listening = await start_node(initial_peers=await visible_maddrs(helper))  # a full node: it listens
        try:
            good = await check_reachability(listening.p2p, [str(helper.peer_id)], await visible_maddrs(listening))
            dead = await check_reachability(listening.p2p, [str(helper.peer_id)], ["/ip4/127.0.0.1/tcp/9"])
        finally:
            await listening.shutdown()
        return good, dead

    good, dead = _two_nodes(body)
    assert good.direct is True and good.answers[0].direct.addr.startswith("/ip4/127.0.0.1/tcp/")
    assert dead.direct is False and "refused" in dead.answers[0].direct.error


def test_bad_input_is_refused_and_the_helper_keeps_answering_within_its_limits():
    async def body(helper, asker):
        _, reader, writer = await asker.p2p.call_binary_stream_handler(helper.peer_id, HANDLE)
        await _send(writer, b"\xc1 not msgpack")
        bad = CheckAnswer.from_bytes(await _receive(reader, 10), "helper")
        writer.close()
        _, reader, writer = await asker.p2p.call_binary_stream_handler(helper.peer_id, HANDLE)
        writer.write((1 << 30).to_bytes(4, "big"))  # a header that announces 1 GiB
        await writer.drain()
        huge = CheckAnswer.from_bytes(await _receive(reader, 10), "helper")
        writer.close()
        answers = [await ask(asker.p2p, helper.peer_id, CheckRequest(("/ip4/127.0.0.1/tcp/9",))) for _ in range(8)]
        return bad, huge, answers

    bad, huge, answers = _two_nodes(body)
    assert bad.refused.startswith("bad request: not a msgpack message")
    assert "exceeds 4096" in huge.refused
    assert [a.refused for a in answers[:6]] == [""] * 6  # 6 dial-backs per caller and minute (bad input dials none)
    assert all(a.direct is not None and not a.direct.ok for a in answers[:6])
    assert all(a.refused.startswith("busy: at most 6 reachability checks per caller") for a in answers[6:])


def test_clients_do_not_answer_checks():
    async def body(helper, asker):
        with pytest.raises(P2PDaemonError, match="protocols not supported"):
            await ask(helper.p2p, asker.peer_id, CheckRequest(()), timeout=5)
        return True

    assert _two_nodes(body)


def test_forced_private_without_relays_is_refused_with_what_to_do():
    async def body(helper, asker):
        with pytest.raises(StartupRefused, match="behind NAT.*drop --no_relay / --no_auto_relay"):
            await start_node(initial_peers=await visible_maddrs(helper), check_reachability=True,
                             nat=NatOptions(use_relay=False, force_reachability="private"))
        return True

    assert _two_nodes(body)
