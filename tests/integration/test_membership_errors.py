"""Issue 15 on a real private swarm: an outsider is told the swarm is private (finding 6); a revoked member's
client, trainer and peer are told within seconds and stop, instead of banning and retrying (finding 15)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes
from privacy.errors import MembershipError
from privacy.membership import MemberCredentials
from swarm.routing import PrivateSwarmError

PRIVATE = "this swarm is private"


@pytest.fixture(scope="module")
def members(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """A private swarm: blocks 0:4 and 4:8 on two member peers that let members train them."""
    with LocalSwarm(tmp_path_factory.mktemp("membership"), update_period=1.0, private=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"member{i}",
                                  extra=["--trainers", "members", "--throughput", "1000"])
                 for i, span in enumerate(("0:4", "4:8"))]
        for proc in procs:
            swarm.wait_ready(proc)
        swarm.owner.save(swarm.workdir / "owner.key")
        yield swarm


def _client(swarm: LocalSwarm, model_dir, swarm_config: SwarmConfig) -> SwarmClient:
    return SwarmClient(model_dir, config=ClientConfig(swarm=swarm_config, request_timeout=10))


def _honest(swarm: LocalSwarm) -> set[str]:
    return {p.peer_id for p in swarm.processes if p.name.startswith("member")}


def _revoke(swarm_cli, swarm: LocalSwarm, *names: str) -> float:
    """The owner runs ``swarm revoke --serial ... --initial_peers ...`` (in this process: ``swarm_cli``)."""
    serials = [MemberCredentials.load(swarm.workdir / "members" / f"{n}.member").certificate.serial for n in names]
    done = swarm_cli("revoke", "--owner_key", str(swarm.workdir / "owner.key"), "--serial", *serials,
                     "--initial_peers", *swarm.initial_peers)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic()


def _until_refused(call, deadline: float) -> BaseException:
    """Call ``call()`` until it raises (the revocation takes a period or two to spread); return what it raised."""
    while True:
        try:
            call()
        except Exception as e:
            return e
        assert time.monotonic() < deadline, "the revoked member is still served"
        time.sleep(0.3)


@pytest.mark.timeout(180)
def test_finding_06_an_outsider_is_told_the_swarm_is_private(members, llama_dir, swarm_cli):
    done = swarm_cli("generate", str(llama_dir), "--prompt", "hi", "--max_new_tokens", "2", "--initial_peers",
                     *members.initial_peers)
    assert done.returncode != 0
    assert f"{PRIVATE}: 2 sealed record(s)" in done.stderr and "--private CREDENTIALS --identity_path" in done.stderr
    assert "No online peer serves" not in done.stderr, done.stderr[-2000:]

    with _client(members, llama_dir, SwarmConfig(initial_peers=tuple(members.initial_peers))) as outsider:
        with pytest.raises(PrivateSwarmError, match=PRIVATE):
            outsider.forward(torch.tensor([[1, 2, 3]]))
        with pytest.raises(PrivateSwarmError, match=PRIVATE):  # training: not "spans () do not tile blocks 0:8"
            SwarmTrainer(outsider, OptimConfig(lr=1e-3), 1).start(wait=1.0)


@pytest.mark.timeout(240)
def test_finding_15_a_revoked_client_and_peer_are_told_and_stop(members, llama_dir, swarm_cli):
    """Generation and forward raise ``MembershipError`` at once, with no ban of the honest peers; the revoked
    peer logs the revocation once and exits non-zero."""
    mallory = members.start_peer(llama_dir, block_indices="0:8", name="mallory", extra=["--throughput", "1"])
    with _client(members, llama_dir, members.swarm_config("mallory-client")) as revoked:
        revoked.wait_for_records(3)
        prompt = torch.tensor([[1, 2, 3]])
        assert revoked.generate(prompt, 2).shape == (1, 5)
        revoked_at = _revoke(swarm_cli, members, "mallory", "mallory-client")
        error = _until_refused(lambda: revoked.forward(prompt), revoked_at + 20)
        assert isinstance(error, MembershipError) and "revoked" in str(error), repr(error)
        started = time.monotonic()
        with pytest.raises(MembershipError, match="revoked"):  # a new session: refused, not banned and retried
            revoked.generate(prompt, 2)
        assert time.monotonic() - started < 10, "a refusal as no member must not be retried"
        assert not revoked.router.banned() & _honest(members)
    try:
        code = mallory.popen.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the revoked peer is still running:\n{mallory.log()[-2000:]}")
    assert code != 0 and "membership ended" in mallory.log() and "revoked" in mallory.log()


@pytest.mark.timeout(240)
def test_finding_15_a_revoked_trainer_is_told_at_once(members, llama_dir, swarm_cli):
    data = TokenBatches(encode_bytes("A private swarm trains together. " * 40), seq_len=16, micro_batch=2, seed=0)
    with _client(members, llama_dir, members.swarm_config("trainer-x")) as client:
        client.wait_for_records(2)
        trainer = SwarmTrainer(client, OptimConfig(lr=1e-3), 2, run_id="revoked-trainer")
        trainer.start()
        trainer.train_step([data.next_micro() for _ in range(2)])
        revoked_at = _revoke(swarm_cli, members, "trainer-x")
        error = _until_refused(lambda: trainer.train_step([data.next_micro() for _ in range(2)]), revoked_at + 20)
        assert isinstance(error, MembershipError) and "revoked" in str(error), repr(error)
        assert not client.router.banned() & _honest(members)


@pytest.mark.timeout(180)
def test_finding_15_a_peer_without_credentials_in_a_private_swarm_stops(members, llama_dir):
    """The "missing certificate" case: its records are refused by every member, so it says so and exits."""
    args = ["peer", str(llama_dir), "--initial_peers", *members.initial_peers, "--block_indices", "0:8",
            "--update_period", "1.0", "--throughput", "10", "--num_threads", "1"]
    proc = SwarmProcess(args, members.workdir / "logs" / "no-credentials.log", "no-credentials")
    members.processes.append(proc)
    try:
        code = proc.popen.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the peer without credentials is still running:\n{proc.log()[-2000:]}")
    assert code != 0 and PRIVATE in proc.log() and "--private CREDENTIALS" in proc.log()
