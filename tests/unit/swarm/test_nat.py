"""NatOptions (table tests) and the flags reaching the p2p daemon: its real command line, read from /proc."""

from __future__ import annotations

import asyncio
import sys

import pytest

from swarm.discovery import start_node, visible_maddrs
from swarm.nat import RELAY_LIMITS, NatOptions, circuit_addrs

BOOT = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooWFpbssVJyMjAxR1t8g32zQT7sprY1LGoWNqXvreHNTk9z"
RELAY = "/ip4/5.6.7.8/tcp/4001/p2p/12D3KooWPJSttMs9APeuDeaWqMsQE3ehgu2Sdey7BcWPgFBSB3zZ"


@pytest.mark.parametrize(("options", "kwargs", "flags"), [
    (NatOptions(), {"use_relay": True, "use_auto_relay": False}, {}),
    (NatOptions(use_relay=False, use_auto_relay=True), {"use_relay": False, "use_auto_relay": False}, {}),
    (NatOptions(use_auto_relay=True), {"use_relay": True, "use_auto_relay": True, "trusted_relays": [BOOT]},
     {"relayDiscovery": False}),  # the initial peers are the relays, reserved at once
    (NatOptions(use_auto_relay=True, relays=(RELAY,)),
     {"use_relay": True, "use_auto_relay": True, "trusted_relays": [RELAY]}, {"relayDiscovery": False}),
    (NatOptions(force_reachability="public"), {"use_relay": True, "use_auto_relay": False,
                                               "force_reachability": "public"}, RELAY_LIMITS),
    (NatOptions(force_reachability="public", use_relay=False),
     {"use_relay": False, "use_auto_relay": False, "force_reachability": "public"}, {}),
    (NatOptions(force_reachability="private", use_auto_relay=True).for_client(),
     {"use_relay": True, "use_auto_relay": False, "force_reachability": "private"}, {}),
])
def test_options_map_onto_p2p_create_and_daemon_flags(options, kwargs, flags):
    assert options.create_kwargs([BOOT]) == kwargs
    assert options.daemon_flags([BOOT]) == flags


@pytest.mark.parametrize(("changes", "error"), [
    ({"force_reachability": "maybe"}, "force_reachability must be one of"),
    ({"relays": ("/ip4/5.6.7.8/tcp/4001",)}, "must be a relay's own full address"),
    ({"relays": (f"{RELAY}/p2p-circuit",)}, "must be a relay's own full address"),
])
def test_bad_options_are_refused(changes, error):
    with pytest.raises(ValueError, match=error):
        NatOptions(**changes)


def test_circuit_addrs():
    assert circuit_addrs([BOOT, RELAY]) == [f"{BOOT}/p2p-circuit", f"{RELAY}/p2p-circuit"]


def _flags(command: list[str]) -> dict[str, str]:
    return dict(arg.lstrip("-").split("=", 1) for arg in command[1:] if "=" in arg)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the daemon's command line from /proc")
def test_the_options_reach_the_daemon():
    async def main():
        relay = await start_node(nat=NatOptions(force_reachability="public"))
        try:
            boot = (await visible_maddrs(relay))[0]
            peer = await start_node(initial_peers=[boot], nat=NatOptions(use_auto_relay=True, relays=(boot,),
                                                                         force_reachability="private"))
            client = await start_node(initial_peers=[boot], client_mode=True, nat=NatOptions(use_relay=False))
            try:
                return [n.p2p.daemon_command() for n in (relay, peer, client)], boot
            finally:
                await asyncio.gather(peer.shutdown(), client.shutdown())
        finally:
            await relay.shutdown()

    (relay, peer, client), boot = asyncio.run(main())
    relay, peer, client = _flags(relay), _flags(peer), _flags(client)
    assert relay["forceReachabilityPublic"] == "1" and relay["relay"] == "1"
    assert relay["relayTimeLimit"] == RELAY_LIMITS["relayTimeLimit"]  # long circuits through the relay
    assert relay["relayDataLimit"] == str(RELAY_LIMITS["relayDataLimit"]) and relay["dhtServer"] == "1"
    assert peer["autoRelay"] == "1" and peer["trustedRelays"] == boot and peer["relayDiscovery"] == "0"
    assert peer["forceReachabilityPrivate"] == "1"
    assert client["relay"] == "0" and client["autoRelay"] == "0" and client["dhtClient"] == "1"
