"""Inference with a codec (``ClientConfig.compression``) through real peers on encrypted streams: ``none`` stays bit
for bit what one process computes; lossy codecs give logits within their bound and (fp16) the same greedy tokens;
a peer refuses a codec it does not know."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from peers.wire.errors import RequestError
from peers.wire.messages import ForwardRequest, InferenceOpen, pack_inference


@pytest.fixture(scope="module")
def clients(three_hop_swarm, llama_dir) -> Iterator[dict[str, SwarmClient]]:
    """One encrypting client per topology on the shared three-hop swarm (its codec switched per test)."""
    made = {}
    for topology in ("chain", "star"):
        config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(three_hop_swarm.initial_peers)),
                              topology=topology)
        made[topology] = SwarmClient(llama_dir, config=config)
    for client in made.values():
        client.wait_for_records(3)
    yield made
    for client in made.values():
        client.close()


def use(client: SwarmClient, compression: str) -> SwarmClient:
    client.config = dataclasses.replace(client.config, compression=compression)
    return client


@pytest.fixture(scope="module")
def local(llama_dir) -> LocalModel:
    return LocalModel.from_dir(llama_dir)


PROMPT = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_none_is_bit_exact(clients, local, topology):
    client = use(clients[topology], "none")
    assert client.config.encrypt
    expected = local.generate_greedy(PROMPT, 24)
    assert client.generate(PROMPT, 24).tolist() == expected.tolist()
    with torch.inference_mode():
        logits, _ = local(PROMPT)
    assert torch.equal(client.forward(PROMPT), logits)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_fp16_tokens_close_to_exact(clients, local, topology):
    client = use(clients[topology], "fp16")
    try:
        expected = local.generate_greedy(PROMPT, 24)[:, 8:]
        got = client.generate(PROMPT, 24)[:, 8:]
        assert (got != expected).float().mean() <= 0.1  # a near-tie may flip a token, and what follows it
        with torch.inference_mode():
            logits, _ = local(PROMPT)
        error = (client.forward(PROMPT) - logits).abs().max()
        assert 0 < error <= 1e-2 * logits.abs().max()  # lossy (each link rounds), but by fp16's ~2^-11 per link
    finally:
        use(client, "none")


CODECS = {"bf16": 0.05, "int8": 0.1, "topk:1.0/int8": 0.1, "topk:0.9": 2.0}  # codec: logit error bound (x max logit)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_each_codec_travels_sealed_through_real_peers(clients, local, topology):
    """Every codec crosses the peers' encrypted streams both ways (client -> peer, peer -> peer pushes in the
    chain, replies) and gives logits near the exact ones; a generation runs with the last one."""
    with torch.inference_mode():
        logits, _ = local(PROMPT)
    client = clients[topology]
    try:
        for codec, bound in CODECS.items():
            got = use(client, codec).forward(PROMPT)
            assert got.shape == logits.shape and torch.isfinite(got).all(), codec
            error = (got - logits).abs().max()
            assert 0 < error <= bound * logits.abs().max(), codec
        assert client.generate(PROMPT, 4).shape == (2, 12)
    finally:
        use(client, "none")


def test_a_peer_refuses_an_unknown_codec(clients):
    client = clients["star"]
    peer = client.records()[0]

    async def open_with(compression: str):
        stream = await client.peer_stream(peer.peer_id)
        return await stream.open(InferenceOpen(session_id="codec-test", start=peer.start, end=peer.end, max_length=8,
                                               batch_size=1, compression=compression), 10)

    reply = client.loop.run(open_with("fp8"))
    assert "unknown codec" in reply.error
    with pytest.raises(ValueError, match="unknown codec"):
        ClientConfig(compression="fp8")
    with pytest.raises(RequestError):  # a forward asking for an unknown codec is refused too, the peer keeps serving
        client.loop.run(_forward(client, peer, "fp8"))
    assert client.loop.run(_forward(client, peer, "fp16")).shape == (1, 3, 64)


async def _forward(client: SwarmClient, peer, compression: str) -> torch.Tensor:
    stream = await client.peer_stream(peer.peer_id)
    reply, output = await stream._request(pack_inference(ForwardRequest(start=peer.start, end=peer.end,
                                                                        compression=compression)),
                                          torch.randn(1, 3, 64), 10)
    if reply.error:
        raise RequestError(reply.error)
    return output
