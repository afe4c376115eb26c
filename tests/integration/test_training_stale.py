"""Asynchronous steps (staleness 1) on real processes: the next step's forwards start while a step drains and
commits; every loss equals a one-process reference with the same schedule (each step's gradients at the weights
before the previous update), in a chain and in a star, and the loss falls."""

from __future__ import annotations

import pytest

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, schedule="constant", clip_norm=1.0, weight_decay=0.01)
TEXT = "Step n+1 starts while step n drains; its gradients are one step old. " * 40
STEPS, ACCUMULATION = 5, 3
STAGES = [(0, 3), (3, 6), (6, 8)]


@pytest.mark.parametrize("topology, stale", [("chain", None), ("star", 1)])
def test_staleness_one_equals_its_local_schedule(train_stages, served_weights, llama_dir, topology, stale):
    """On the stage peers shared with other modules (``conftest.py``): both references start from the weights
    they serve when the run starts (earlier runs trained them). ``stale``: how many of a step's micro-batches start
    while the previous step drains (all of them in the chain, the default 1 in the star)."""
    swarm, procs = train_stages
    config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=30)
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(3)
        reference = served_weights(client, LocalTrainer(llama_dir, OPTIM, ACCUMULATION, stages=STAGES, staleness=1,
                                                        stale_micro_batches=stale), procs)
        synchronous = served_weights(client, LocalTrainer(llama_dir, OPTIM, ACCUMULATION, stages=STAGES), procs)
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=3, run_id=f"stale-{topology}",
                               topology=topology, staleness=1, stale_micro_batches=stale)
        trainer.start()
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=1)
        steps = [[data.next_micro() for _ in range(ACCUMULATION)] for _ in range(STEPS)]
        swarm_losses, local_losses = [], []
        for n, micro in enumerate(steps):
            upcoming = steps[n + 1] if n + 1 < STEPS else None
            result = trainer.train_step(micro, upcoming)
            assert result.stage_steps == [n + 1] * 3
            assert trainer.ahead_batches == (ACCUMULATION if upcoming is not None else 0)
            swarm_losses.append(result.loss)
            local_losses.append(reference.train_step(micro))
        assert swarm_losses == pytest.approx(local_losses, abs=1e-6)
        assert swarm_losses[-1] < swarm_losses[0]
        sync_losses = [synchronous.train_step(micro) for micro in steps]
        assert sync_losses[2:] != pytest.approx(local_losses[2:], abs=1e-6)  # a different schedule indeed
        ids = data.next_micro()
        served = client.forward(ids)  # the peers serve the weights they trained
        assert (served - reference.logits(ids).detach()).abs().max() <= 1e-5
