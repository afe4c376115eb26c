"""LoRA adapters on a public swarm's peers (issue 19) on real processes: peers started with no ``--trainers`` refuse
base training but train a run's own adapters (the default ``--adapters anyone``); a LoRA run through 3 peers gives
the losses of the same LoRA run in one process, bit for bit in fp32, while another client's greedy generation stays
identical before, during and after it; the adapters belong to the run's trainer."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsFetch

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, schedule="constant", clip_norm=1.0, weight_decay=0.01)
ADAPTER = "lora:r=4,alpha=8,targets=q_proj+v_proj+down_proj"
SEED = 11
TEXT = "Adapters belong to the run; the shared weights stay as they are for everyone else. " * 40
STEPS, ACCUMULATION = 4, 2
STAGES = {"a": "0:3", "b": "3:6", "c": "6:8"}
PROMPT = torch.tensor([[72, 101, 108, 108, 111, 32]])


@pytest.fixture(scope="module")
def adapter_swarm(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, dict[str, SwarmProcess]]]:
    """Three peers with no --trainers (a public swarm's default) and --checkpoint_dir."""
    workdir = tmp_path_factory.mktemp("adapter_swarm")
    with LocalSwarm(workdir, update_period=1.0) as swarm:
        swarm.start_dht()
        procs = {name: swarm.start_peer(llama_dir, block_indices=span, wait=False, name=name,
                                        extra=["--checkpoint_dir", str(workdir / f"ckpt-{name}")])
                 for name, span in STAGES.items()}
        for proc in procs.values():
            swarm.wait_ready(proc)
        yield swarm, procs


def _client(swarm: LocalSwarm, llama_dir, name: str = "trainer") -> SwarmClient:
    client = SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(name), request_timeout=30))
    client.wait_for_records(3)
    return client


def test_lora_run_equals_one_process_and_leaves_others_unchanged(adapter_swarm, llama_dir):
    swarm, procs = adapter_swarm
    with _client(swarm, llama_dir) as client, _client(swarm, llama_dir, "other") as other:
        base = SwarmTrainer(client, OPTIM, ACCUMULATION, run_id="base-run")
        with pytest.raises(RequestError, match="does not train"):  # no --trainers: the blocks never train
            base.start()
        greedy = other.generate(PROMPT, 12)
        reference = LocalTrainer(llama_dir, OPTIM, ACCUMULATION, stages=[(0, 3), (3, 6), (6, 8)], adapter=ADAPTER,
                                 seed=SEED)
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=2, run_id="lora-run", adapter=ADAPTER,
                               adapter_seed=SEED, checkpoint_every=STEPS)
        trainer.start()
        during: list[torch.Tensor] = []
        stop = threading.Event()

        def generate_meanwhile() -> None:
            while not stop.is_set():
                during.append(other.generate(PROMPT, 12))

        generating = threading.Thread(target=generate_meanwhile)
        generating.start()
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=1)
        swarm_losses, local_losses = [], []
        try:
            for _ in range(STEPS):
                micro = [data.next_micro() for _ in range(ACCUMULATION)]
                swarm_losses.append(trainer.train_step(micro).loss)
                local_losses.append(reference.train_step(micro))
        finally:
            stop.set()
            generating.join()
        assert swarm_losses == local_losses  # bit-equal in fp32
        assert swarm_losses[-1] < swarm_losses[0]
        assert during and all(torch.equal(g, greedy) for g in during)
        assert torch.equal(other.generate(PROMPT, 12), greedy)
        # the adapters are the run's trainer's: another peer id cannot fetch (nor reopen) them
        stage = procs["b"]
        mine = client.loop.run(client.peer_stream(stage.peer_id))
        _, flat = client.loop.run(mine.call(ParamsFetch(start=3, end=6, run_id="lora-run"), None, 10))
        want = torch.cat([p.detach().reshape(-1) for p in reference.adapters[1].params()])
        assert torch.equal(flat, want)
        theirs = other.loop.run(other.peer_stream(stage.peer_id))
        with pytest.raises(RequestError, match="another trainer's adapters"):
            other.loop.run(theirs.call(ParamsFetch(start=3, end=6, run_id="lora-run"), None, 10))
