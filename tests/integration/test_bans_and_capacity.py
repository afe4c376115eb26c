"""Issue 15 on real processes: one kill is one ban for every session and the trainer that share a client's router
(finding 5); a peer whose cache is full is routed around, not banned, and "all busy" says so (finding 6)."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from peers.client.generation import generate_stream
from peers.client.inference_session import InferenceSession
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes
from swarm.routing import PeersUnavailableError

BAN_TIME = 30.0  # long enough that every report of the kill lands within the first ban


def _two_replicas(swarm, llama_dir, *extra: str):
    """A fast peer (chosen first) and a slow replica, both serving all 8 blocks."""
    procs = [swarm.start_peer(llama_dir, block_indices="0:8", wait=False, name=name,
                              extra=["--throughput", throughput, *extra])
             for name, throughput in (("fast", "1000"), ("slow", "10"))]
    for proc in procs:
        swarm.wait_ready(proc)
    return procs


def _client(swarm, llama_dir, **kwargs) -> SwarmClient:
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=10, **kwargs)
    client = SwarmClient(llama_dir, config=config)
    client.wait_for_records(2)
    return client


@pytest.mark.timeout(300)
def test_finding_05_one_kill_is_one_ban_for_all_sessions_and_the_trainer(fresh_swarm, llama_dir):
    fast, slow = _two_replicas(fresh_swarm, llama_dir, "--trainers", "anyone")
    prompts = [torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    local = LocalModel.from_dir(llama_dir)
    expected = [local.generate_greedy(p, 24)[0, 6:].tolist() for p in prompts]
    data = TokenBatches(encode_bytes("One kill, one ban. " * 60), seq_len=16, micro_batch=2, seed=0)
    with _client(fresh_swarm, llama_dir, ban_time=BAN_TIME, max_ban_time=4 * BAN_TIME) as client:
        trainer = SwarmTrainer(client, OptimConfig(lr=1e-3), 2, run_id="finding-05")
        assert [s.peer_id for s in trainer.start()] == [fast.peer_id]  # no step yet: the weights stay the model's
        started = []

        async def one(prompt: torch.Tensor) -> list[int]:
            tokens = []
            async for token in generate_stream(client, prompt, 24):
                tokens.append(int(token[0]))
                if len(tokens) == 5:
                    started.append(prompt)
                    if len(started) == len(prompts):  # every session is mid-generation on the fast peer
                        fast.kill(signal.SIGKILL)
                await asyncio.sleep(0)
            return tokens

        async def all_sessions():
            return await asyncio.gather(*(one(p) for p in prompts))

        assert client.loop.run(all_sessions()) == expected  # all recovered on the slow replica
        result = trainer.train_step([data.next_micro() for _ in range(2)])  # its stream to the killed peer broke
        assert result.stage_peers == [slow.peer_id]
        ban = client.router.ban(fast.peer_id)
        assert ban is not None and ban.duration == BAN_TIME, "one kill must be one ban, however many saw it"
        assert slow.peer_id not in client.router.banned()


@pytest.mark.timeout(300)
def test_finding_06_a_full_cache_is_busy_not_banned(fresh_swarm, llama_dir):
    fast, slow = _two_replicas(fresh_swarm, llama_dir, "--cache_tokens", "40")
    prompt = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(5))
    with _client(fresh_swarm, llama_dir) as client:
        run = client.loop.run
        first = run(InferenceSession(client, max_length=30).__aenter__())
        assert [h.peer_id for h in first.hops] == [fast.peer_id]
        second = run(InferenceSession(client, max_length=30).__aenter__())  # the fast peer's cache is full
        assert [h.peer_id for h in second.hops] == [slow.peer_id]
        assert client.router.ban(fast.peer_id) is None, "a full cache is no failure: no ban"

        client.router.max_wait = 3.0
        with pytest.raises(PeersUnavailableError) as info:  # both full: not "No online peer serves"
            run(InferenceSession(client, max_length=30).__aenter__())
        message = str(info.value)
        assert "all 2 peer(s) serving blocks 0:8 of llama-tiny are busy" in message and "cache full" in message
        assert client.router.banned() == set()

        run(first.close())
        client.router.max_wait = 30.0
        expected = LocalModel.from_dir(llama_dir).generate_greedy(prompt, 6)
        assert client.generate(prompt, 6).tolist() == expected.tolist()  # waits for the busy mark, then fits
        run(second.close())
        assert client.router.banned() == set()
