"""Inference streams are end-to-end encrypted: what reaches the p2p daemon is ciphertext; forgeries are refused."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import p2p_daemon

from peers.cli.launch import LocalSwarm
from peers.client.inference_session import SpanSession
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from peers.wire.errors import RequestError
from peers.wire.framing import FrameWriter
from peers.wire.messages import InferenceHello, InferenceStep, pack_inference
from peers.wire.stream import PeerStream
from peers.wire.tensors import tensor_messages
from privacy.channel import ClientHandshake, new_session_id
from privacy.errors import ChannelError
from privacy.identity import Identity


@pytest.fixture(scope="module")
def open_peer(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, str]]:
    """One peer with all blocks that also accepts plaintext streams (so both modes can be compared)."""
    with LocalSwarm(tmp_path_factory.mktemp("encryption"), update_period=2.0) as swarm:
        swarm.start_dht()
        peer = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--allow_plaintext", "--trainers", "anyone"])
        yield swarm, peer.peer_id


def _client(swarm, model_dir, *, encrypt: bool) -> SwarmClient:
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), encrypt=encrypt)
    client = SwarmClient(model_dir, config=config)
    client.wait_for_records(1)
    return client


@pytest.fixture
def wire(monkeypatch) -> list[bytes]:
    """Every byte this process hands to a p2p daemon: our streams' frames and hivemind's protobuf messages."""
    sent: list[bytes] = []
    original_protobuf, original_frames = p2p_daemon.P2P.send_protobuf, FrameWriter.send

    async def recording(protobuf, writer):
        sent.append(protobuf.SerializeToString())
        return await original_protobuf(protobuf, writer)

    async def recording_frames(self, *frames):
        sent.extend(frames)
        return await original_frames(self, *frames)

    monkeypatch.setattr(p2p_daemon.P2P, "send_protobuf", staticmethod(recording))
    monkeypatch.setattr(FrameWriter, "send", recording_frames)
    return sent


@pytest.mark.parametrize("encrypt", [True, False])
def test_daemon_sees_no_plaintext_hidden_states(open_peer, llama_dir, wire, encrypt):
    swarm, peer_id = open_peer
    with _client(swarm, llama_dir, encrypt=encrypt) as client:
        span = SpanSession(client, peer_id, 0, 8, secrets.token_hex(8))
        client.loop.run(span.open(16, 1))
        hidden = torch.randn(1, 4, 64)
        wire.clear()
        client.loop.run(span.step(hidden))
        client.loop.run(span.close())
    needle = hidden.numpy().tobytes()[:32]  # any 8 consecutive activations, as they would appear in plaintext
    found = any(needle in message for message in wire)
    assert wire and found == (not encrypt)  # the control (encryption off) shows the search would find them


@pytest.mark.parametrize("encrypt", [True, False])
def test_daemon_sees_no_plaintext_in_a_forward(open_peer, llama_dir, wire, encrypt):
    swarm, peer_id = open_peer
    with _client(swarm, llama_dir, encrypt=encrypt) as client:
        hidden = torch.randn(2, 5, 64)
        client.loop.run(client.peer_stream(peer_id))  # the handshake is not what we search
        wire.clear()
        output = client.loop.run(client.call_forward(peer_id, hidden, 0, 8))
    assert output.shape == hidden.shape
    needle = hidden.numpy().tobytes()[64:96]
    assert wire and any(needle in message for message in wire) == (not encrypt)


def test_generation_is_identical_with_encryption_on_and_off(open_peer, llama_dir):
    swarm, _ = open_peer
    input_ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    outputs = {}
    for encrypt in (True, False):
        with _client(swarm, llama_dir, encrypt=encrypt) as client:
            outputs[encrypt] = client.generate(input_ids, 16)
            stream = client.loop.run(client.peer_stream(client.records()[0].peer_id))
            assert stream.encrypted == encrypt
    assert outputs[True].tolist() == outputs[False].tolist()


def _forged_step(client, stream: PeerStream, span: SpanSession, hidden: torch.Tensor, mutate) -> str:
    """Send a hand-made step message (mutated after sealing) on the stream; return the peer's error."""

    async def go():
        metadata = pack_inference(InferenceStep(session_ids=[span.session_id], positions=[span.length]))
        messages = list(tensor_messages(hidden, metadata, seal=stream._seal))
        mutate(messages)
        reply, _ = await asyncio.wait_for(stream.send_raw(messages), 10)
        return reply.error

    return client.loop.run(go())


def test_tampered_and_replayed_messages_are_refused_and_the_session_continues(open_peer, llama_dir):
    swarm, peer_id = open_peer
    with _client(swarm, llama_dir, encrypt=True) as client:
        span = SpanSession(client, peer_id, 0, 8, secrets.token_hex(8))
        client.loop.run(span.open(16, 1))
        stream = client.loop.run(client.peer_stream(peer_id))
        first = torch.randn(1, 2, 64)
        out_first = client.loop.run(span.step(first))

        def flip_last_byte(messages):
            chunk = messages[0].tensors[0]
            chunk.buffer = chunk.buffer[:-1] + bytes([chunk.buffer[-1] ^ 1])

        error = _forged_step(client, stream, span, torch.randn(1, 1, 64), flip_last_byte)
        assert "failed authentication" in error

        sealed_once = []
        second = torch.randn(1, 1, 64)
        assert _forged_step(client, stream, span, second, sealed_once.extend) == ""  # genuine, and recorded
        span.length, span.history = 3, [first, second]
        error = _forged_step(client, stream, span, torch.randn(1, 1, 64),
                             lambda messages: messages.__setitem__(slice(None), sealed_once))  # replayed
        assert "replayed or reordered" in error

        more = torch.randn(1, 2, 64)
        out_more = client.loop.run(span.step(more))  # the session still works: tokens 3..4, cache intact
    model = LocalModel.from_dir(llama_dir)
    with torch.inference_mode():
        expected, _ = model.blocks(torch.cat([first, second, more], 1), torch.arange(5)[None])
    assert (out_first - expected[:, :2]).abs().max() < 1e-4 and (out_more - expected[:, 3:]).abs().max() < 1e-4


def test_wrong_peer_key_fails_the_handshake(open_peer, llama_dir):
    swarm, peer_id = open_peer
    with _client(swarm, llama_dir, encrypt=False) as client:
        stream = client.loop.run(PeerStream.without_hello(client.node.p2p, peer_id))
        impostor = ClientHandshake(Identity.generate().public_bytes, new_session_id())  # not this peer's key

        async def go():
            reply, _ = await stream._request(pack_inference(InferenceHello(hello=impostor.hello())), None, 10)
            return reply

        reply = client.loop.run(go())
        with pytest.raises(ChannelError, match="not the peer"):
            impostor.finish(reply.handshake)


def test_peer_refuses_plaintext_streams_by_default(fresh_swarm, llama_dir):
    fresh_swarm.start_peer(llama_dir, block_indices="0:8")
    with _client(fresh_swarm, llama_dir, encrypt=False) as client:
        with pytest.raises(RequestError, match="only takes encrypted streams"):
            client.generate(torch.tensor([[1, 2, 3]]), 2)


def test_training_is_identical_with_encryption_on_and_off_and_never_plaintext(open_peer, llama_dir, wire):
    """A 1e-30 learning rate is below fp32 resolution: the peer keeps its weights, so both runs see the same model."""
    from peers.model.local import default_position_ids
    from peers.trainer.swarm_trainer import SwarmTrainer
    from peers.training import OptimConfig, TokenBatches, encode_bytes

    swarm, _ = open_peer
    results = {}
    for encrypt in (True, False):
        data = TokenBatches(encode_bytes("Encrypted or not, the same numbers. " * 30), seq_len=12, micro_batch=2,
                            seed=4)
        with _client(swarm, llama_dir, encrypt=encrypt) as client:
            trainer = SwarmTrainer(client, OptimConfig(lr=1e-30, weight_decay=0.0), 2, run_id=f"enc-{encrypt}")
            trainer.start()
            wire.clear()
            micro = [data.next_micro() for _ in range(2)]
            losses = [trainer.train_step(micro).loss, trainer.train_step([data.next_micro() for _ in range(2)]).loss]
            with torch.no_grad():
                embedded = client.embedding.embed(micro[0], default_position_ids(micro[0]))
            needle = embedded.numpy().tobytes()[64:96]
            results[encrypt] = (losses, trainer.part.last_grad_norm, any(needle in m for m in wire))
    assert results[True][:2] == results[False][:2]  # losses and the grad-norm that came back through the peer
    assert results[True][2] is False and results[False][2] is True  # the control finds the plaintext


def test_token_ids_and_logits_never_leave_the_client(open_peer, llama_dir, wire):
    """Even with encryption off (so that the search can see everything), no outgoing message carries the
    prompt's or the generated token ids, nor logits: only hidden states travel (found here as the control)."""
    import msgpack

    from peers.model.local import default_position_ids

    swarm, _ = open_peer
    prompt = torch.tensor([[201, 57, 133, 240, 17, 99, 3, 250]])
    with _client(swarm, llama_dir, encrypt=False) as client:
        wire.clear()
        logits = client.forward(prompt)
        generated = client.generate(prompt, 6)
        with torch.no_grad():
            embedded = client.embedding.embed(prompt, default_position_ids(prompt))
    assert wire
    ids = generated[0].tolist()
    needles = {
        "prompt ids (int64)": prompt.numpy().tobytes(),
        "prompt ids (int32)": prompt.to(torch.int32).numpy().tobytes(),
        "all ids (int64)": generated.numpy().tobytes(),
        "new ids (int64)": torch.tensor(ids[-6:]).numpy().tobytes(),
        "prompt ids (msgpack list)": msgpack.packb(prompt[0].tolist())[1:],
        "logits (float32)": logits[0, -1, :8].numpy().tobytes(),
        "logits of the first token": logits[0, 0, 100:108].numpy().tobytes(),
    }
    leaks = [name for name, needle in needles.items() if any(needle in message for message in wire)]
    assert leaks == []
    assert any(embedded.numpy().tobytes()[64:96] in message for message in wire)  # the search works
