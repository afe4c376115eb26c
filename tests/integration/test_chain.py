"""The chain (issue 12): peers hand their outputs straight to each other; results equal one process in both
topologies, pushes come only from the upstream the client named, and a peer that dies is replaced by replaying
the outputs its upstream kept."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.client.chain_session import ChainSession
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from peers.model.local import default_position_ids
from peers.wire.errors import ChainError, RequestError

SPANS = ("0:3", "3:6", "6:8")


def _client(swarm: LocalSwarm, model_dir, topology: str = "chain") -> SwarmClient:
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), topology=topology,
                          request_timeout=10)
    return SwarmClient(model_dir, config=config)


def _start(swarm: LocalSwarm, model_dir, spans) -> list:
    procs = [swarm.start_peer(model_dir, block_indices=s, wait=False) for s in spans]
    for proc in procs:
        swarm.wait_ready(proc)
    return procs


def _span(proc) -> str:
    return f"{proc.blocks[0]}:{proc.blocks[1]}"


def _client_bytes(client: SwarmClient) -> int:
    return sum(s.bytes_sent + s.bytes_received for s in client._links._streams.values())


@pytest.fixture(scope="module")
def chain_swarm(three_hop_swarm) -> LocalSwarm:
    """Peers for blocks 0:3, 3:6 and 6:8 (shared with other modules: ``conftest.py``)."""
    return three_hop_swarm


def test_logits_and_tokens_equal_one_process_in_both_topologies(chain_swarm, llama_dir):
    local = LocalModel.from_dir(llama_dir)
    input_ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(21))
    with torch.inference_mode():
        expected_logits, _ = local(input_ids)
    expected_tokens = local.generate_greedy(input_ids, 16).tolist()
    crossing = {}
    for topology in ("chain", "star"):
        with _client(chain_swarm, llama_dir, topology) as client:
            client.wait_for_records(3)
            assert torch.equal(client.forward(input_ids), expected_logits), topology
            client.generate(input_ids, 2)  # streams opened: the next generation's bytes are its own
            before = _client_bytes(client)
            assert client.generate(input_ids, 16).tolist() == expected_tokens, topology
            crossing[topology] = _client_bytes(client) - before
    # the star carries every hop's input and output across the client's link (6 hidden states a token with 3
    # hops), the chain the first input and the last output (2) plus small requests to each hop
    assert crossing["chain"] < 0.5 * crossing["star"], crossing


def test_pushes_only_from_the_named_upstream_and_bad_steps_are_refused(chain_swarm, llama_dir):
    local = LocalModel.from_dir(llama_dir)
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(22))
    with torch.inference_mode():
        expected, _ = local(input_ids)
    with _client(chain_swarm, llama_dir) as client:
        client.wait_for_records(3)
        hidden_size = client.model_config.hidden_size

        async def run(bad_requests: bool) -> torch.Tensor:
            async with ChainSession(client, max_length=16) as session:
                first, middle = session.hops[0], session.hops[1]
                if bad_requests:
                    stream = await client.peer_stream(middle.peer_id)
                    stray = torch.randn(1, 1, hidden_size)
                    with pytest.raises(RequestError, match="is not the upstream of session"):
                        await stream.push(middle.session_id, 0, stray, 10)  # we are not the upstream it was told
                    with pytest.raises(RequestError, match="not open on this peer"):
                        await stream.push("no-such-session", 0, stray, 10)
                    with pytest.raises(RequestError, match="must carry it"):
                        await first.queue(0, None, tokens=1, returns=False)  # the first hop's input comes from us
                    with pytest.raises(RequestError, match="without a tensor"):
                        await middle.queue(0, stray, tokens=1, returns=False)  # the middle one's from upstream
                with torch.inference_mode():
                    hidden = client.embedding(input_ids, default_position_ids(input_ids))
                out = await session.step(hidden)
                with torch.inference_mode():
                    return client.head(out)

        clean = client.loop.run(run(bad_requests=False))
        refused = client.loop.run(run(bad_requests=True))
    # the session with refused requests goes on untouched: bit for bit what a clean session gives (a cached
    # step may differ from one full forward in the last bit, by the attention kernel's shapes)
    assert torch.equal(refused, clean)
    torch.testing.assert_close(clean, expected, rtol=0, atol=1e-5)


def test_the_upstream_names_a_downstream_that_is_gone(fresh_swarm, llama_dir):
    procs = _start(fresh_swarm, llama_dir, ("0:4", "4:8"))
    with _client(fresh_swarm, llama_dir) as client:
        client.wait_for_records(2)
        hidden = torch.randn(1, 3, client.model_config.hidden_size)

        async def run() -> ChainError:
            async with ChainSession(client, max_length=16) as session:
                first, last = session.hops
                assert (first.downstream, last.upstream) == (last.peer_id, first.peer_id)
                procs[1].kill(signal.SIGKILL)
                procs[1].popen.wait(10)
                with pytest.raises(ChainError) as caught:
                    await first.queue(0, hidden, tokens=3, returns=False)
                return caught.value

        error = client.loop.run(run())
    assert error.failed_peer == procs[1].peer_id
    assert "could not hand the output" in str(error)


KILLS = {  # after how many tokens which spans lose the peer that holds the session (run in this order)
    "first": {8: ("0:3",)},
    "middle_then_last": {8: ("3:6",), 16: ("6:8",)},
    "two_adjacent_at_once": {10: ("3:6", "6:8")},  # the replay's source is gone too
}
FROZEN = {8: ("3:6",)}
SPARES = ("0:3", "0:3", "3:6", "3:6", "3:6", "6:8", "6:8", "6:8")  # enough for every case's victims


@pytest.fixture(scope="module")
def spare_swarm(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, list, list]]:
    """Spare peers for every span, shared by the failure cases: (swarm, its peers, those killed so far)."""
    with LocalSwarm(tmp_path_factory.mktemp("spare_swarm"), update_period=1.0) as swarm:
        swarm.start_dht()
        yield swarm, _start(swarm, llama_dir, SPARES), []


@pytest.mark.parametrize("case", list(KILLS))
def test_sigkill_mid_generation_gives_identical_tokens(spare_swarm, llama_dir, case):
    _generate_through_failures(*spare_swarm, llama_dir, case)


def test_a_frozen_middle_peer_is_replaced_not_its_live_upstream(fresh_swarm, llama_dir):
    """SIGSTOP: no connection reset, no heartbeats; the first peer waits on it, alive. (A swarm of its own: a frozen
    peer also slows the DHT lookups that go through it.)"""
    procs = _start(fresh_swarm, llama_dir, ("0:3", "3:6", "6:8", "3:6"))
    _generate_through_failures(fresh_swarm, procs, [], llama_dir, "middle_frozen")


def _generate_through_failures(swarm: LocalSwarm, procs: list, dead: list, llama_dir, case: str) -> None:
    input_ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(23))
    expected = LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 24)[0, 8:].tolist()
    kills = FROZEN if case == "middle_frozen" else KILLS[case]
    with _client(swarm, llama_dir) as client:
        client.wait_for_records(len(procs) - len(dead))
        tokens, killed = [], []
        for token in client.iter_generate(input_ids, 24):
            tokens.append(int(token[0]))
            victims = [p for span in kills.get(len(tokens), ()) for p in procs
                       if p not in dead and _span(p) == span and client.info(p.peer_id).sessions > 0]
            assert len(victims) == len(kills.get(len(tokens), ())), "one peer of each span holds the session"
            for proc in victims:
                proc.kill(signal.SIGSTOP if case.endswith("frozen") else signal.SIGKILL)
            killed += victims
            dead += victims
        for proc in killed:
            took_over = [p for p in procs if p.blocks == proc.blocks and p not in dead]
            assert any(client.info(p.peer_id).sessions > 0 or client.info(p.peer_id).inference_steps > 0
                       for p in took_over), f"nobody took over {proc.blocks}"
        alive = {p.peer_id for p in procs if p not in dead}
        assert not set(client.router.banned()) & alive, "a live peer was blamed for another's failure"
    assert tokens == expected
