"""A private swarm on real processes: members work; non-members, expired and revoked members are shut out."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from peers.wire.errors import RequestError
from peers.wire.messages import InferenceStep, pack_inference
from peers.wire.stream import PeerStream
from privacy.errors import MembershipError
from swarm.discovery import announce
from swarm.keys import peers_key
from swarm.records import PeerRecord, PeerState


@pytest.fixture(scope="module")
def private_swarm(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("private_swarm"), update_period=1.0, private=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"member{i}")
                 for i, span in enumerate(("0:4", "4:8"))]
        for proc in procs:
            swarm.wait_ready(proc)
        yield swarm


def _client(swarm: LocalSwarm, model_dir, swarm_config: SwarmConfig | None = None, **kwargs) -> SwarmClient:
    config = swarm_config or SwarmConfig(initial_peers=tuple(swarm.initial_peers))
    return SwarmClient(model_dir, config=ClientConfig(swarm=config, request_timeout=10, **kwargs))


def _peer_ids(swarm: LocalSwarm) -> list[str]:
    return [p.peer_id for p in swarm.processes if getattr(p, "peer_id", None)]


def test_member_generates_like_the_local_model(private_swarm, llama_dir):
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 5)
    with _client(private_swarm, llama_dir, private_swarm.swarm_config("alice")) as client:
        client.wait_for_records(2)
        assert client.generate(input_ids, 5).tolist() == expected.tolist()
        reference, _ = LocalModel.from_dir(llama_dir)(input_ids)
        assert (client.forward(input_ids) - reference).abs().max() < 1e-4
        assert client.info(_peer_ids(private_swarm)[0]).start == 0


def test_non_member_reads_no_records_and_its_calls_are_refused(private_swarm, llama_dir):
    with _client(private_swarm, llama_dir) as outsider:  # knows the bootstrap address, has no credentials
        time.sleep(1.0)
        assert outsider.records() == []
        found = outsider.loop.run(outsider.node.get(peers_key(outsider.model_name), latest=True))
        assert found is not None and len(found.value) == 2  # sealed records exist, but say nothing readable
        sealed = msgpack.packb([item.value for item in found.value.values()], use_bin_type=True)
        assert b"llama-tiny" not in sealed and b"/ip4/127.0.0.1" not in sealed and b"throughput" not in sealed

        peer_id = _peer_ids(private_swarm)[0]
        with pytest.raises(Exception, match="not a member|serves only members"):
            outsider.info(peer_id)
        with pytest.raises(MembershipError, match="not admitted"):
            outsider.loop.run(PeerStream.connect(outsider.node.p2p, peer_id, timeout=10))

        async def plaintext_step_without_hello():  # skipping the hello does not skip admission
            stream = await PeerStream.without_hello(outsider.node.p2p, peer_id)
            try:
                reply, _ = await stream._request(pack_inference(InferenceStep(session_ids=["s"], positions=[0])),
                                                 torch.randn(1, 2, 64), 10)
                return reply.error
            finally:
                stream.shutdown()

        assert "not admitted" in outsider.loop.run(plaintext_step_without_hello())
        with pytest.raises((RequestError, RuntimeError, MembershipError)):
            outsider.forward(torch.tensor([[1, 2, 3]]))


def test_non_member_announcements_are_rejected(private_swarm, llama_dir):
    with _client(private_swarm, llama_dir) as outsider, \
            _client(private_swarm, llama_dir, private_swarm.swarm_config("bob")) as member:
        fake = PeerRecord(peer_id=str(outsider.node.peer_id), model=outsider.model_name, start=0, end=8,
                          state=PeerState.ONLINE, throughput=1e9)
        outsider.loop.run(announce(outsider.node, fake, ttl=30))
        time.sleep(1.0)
        seen = member.wait_for_records(2)
        assert sorted(r.peer_id for r in seen) == sorted(_peer_ids(private_swarm))
        assert fake.peer_id not in [r.peer_id for r in member.records()]


def test_expired_certificate_is_refused(private_swarm, llama_dir):
    issued = time.time()  # before the certificate: it expires by issued + 6 s
    config = private_swarm.swarm_config("shortlived", ttl=6.0)
    with _client(private_swarm, llama_dir, config) as client:
        client.wait_for_records(2)
        client.forward(torch.tensor([[1, 2, 3]]))  # valid now
        time.sleep(max(0.0, issued + 6.5 - time.time()))
        peer_id = _peer_ids(private_swarm)[0]
        with pytest.raises(Exception, match="expired"):
            client.info(peer_id)
        with pytest.raises(RequestError, match="expired"):  # the open stream is refused too
            client.loop.run(client.call_forward(peer_id, torch.randn(1, 2, 64), 0, 4))
    with pytest.raises(MembershipError, match="expired"):  # and the node will not start with it
        _client(private_swarm, llama_dir, config)


def test_revoked_member_is_shut_out(private_swarm, llama_dir, tmp_path, swarm_cli):
    """`swarm revoke --initial_peers` publishes; peers apply it, refuse the member and drop its records."""
    mallory = private_swarm.start_peer(llama_dir, block_indices="0:8", name="mallory")
    config = private_swarm.swarm_config("mallory-client")
    owner_key = tmp_path / "owner.key"
    private_swarm.owner.save(owner_key)
    with _client(private_swarm, llama_dir, config) as revoked, \
            _client(private_swarm, llama_dir, private_swarm.swarm_config("carol")) as member:
        assert mallory.peer_id in [r.peer_id for r in member.wait_for_records(3)]
        revoked.forward(torch.tensor([[1, 2, 3]]))
        serials = [_serial(private_swarm, name) for name in ("mallory", "mallory-client")]
        done = swarm_cli("revoke", "--owner_key", str(owner_key), "--serial", *serials, "--initial_peers",
                         *private_swarm.initial_peers)
        assert done.returncode == 0, done.stdout + done.stderr
        deadline = time.monotonic() + 20
        while mallory.peer_id in [r.peer_id for r in member.records()]:
            assert time.monotonic() < deadline, "the revoked peer's record is still served"
            time.sleep(0.5)
        honest = _peer_ids(private_swarm)[0]
        deadline = time.monotonic() + 20
        while True:
            try:
                revoked.loop.run(revoked.call_forward(honest, torch.randn(1, 2, 64), 0, 4))
            except (RequestError, MembershipError) as e:  # on its open stream, or on opening a new one
                assert "revoked" in str(e)
                break
            assert time.monotonic() < deadline, "the revoked member is still served"
            time.sleep(0.5)
        input_ids = torch.tensor([[5, 6, 7]])
        reference, _ = LocalModel.from_dir(llama_dir)(input_ids)
        assert (member.forward(input_ids) - reference).abs().max() < 1e-4  # everyone else is still served
    mallory.stop()


def _serial(swarm: LocalSwarm, name: str) -> str:
    from privacy.membership import MemberCredentials

    return MemberCredentials.load(swarm.workdir / "members" / f"{name}.member").certificate.serial


def test_generate_command_with_private(private_swarm, llama_dir, swarm_cli):
    """`swarm generate --private CREDENTIALS` as a newcomer would type it (run in this process: ``swarm_cli``)."""
    identity_path, credentials_path = private_swarm.member_files("cli-user")
    args = ["generate", str(llama_dir), "--prompt", "hello", "--max_new_tokens", "4", "--initial_peers",
            *private_swarm.initial_peers, "--identity_path", str(identity_path), "--private", str(credentials_path)]
    done = swarm_cli(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("hello")
    outsider = swarm_cli(*args[:-4])
    assert outsider.returncode != 0 and "private swarm" in outsider.stderr
