"""The client and the trainer of test_wan_swarm.py, run inside testbed hosts (``ip netns exec``).

``python wan_jobs.py generate SPEC.json`` and ``python wan_jobs.py train SPEC.json`` read what to do from SPEC
(model folder, initial peers, this host's address, inputs) and print one line ``result {json}``.
"""

from __future__ import annotations

import json
import sys

import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes


def _client(spec: dict, identity_path: str | None = None) -> SwarmClient:
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), host_maddrs=(f"/ip4/{spec['address']}/tcp/0",),
                        identity_path=identity_path)
    client = SwarmClient(spec["model_dir"], config=ClientConfig(swarm=swarm, request_timeout=30))
    client.wait_for_records(spec["peers"])
    return client


def generate(spec: dict) -> dict:
    with _client(spec) as client:
        ids = torch.tensor(spec["input_ids"])
        return {"tokens": client.generate(ids, spec["max_new_tokens"]).tolist()}


def train(spec: dict) -> dict:
    optim = OptimConfig(**spec["optim"])
    with _client(spec, spec["identity_path"]) as client:
        trainer = SwarmTrainer(client, optim, spec["accumulation"], in_flight=1, run_id=spec["run_id"])
        trainer.start()
        data = TokenBatches(encode_bytes(spec["text"]), seq_len=spec["seq_len"], micro_batch=spec["micro_batch"],
                            seed=spec["seed"])
        losses = [trainer.train_step([data.next_micro() for _ in range(spec["accumulation"])]).loss
                  for _ in range(spec["steps"])]
        probe = data.next_micro()
        return {"losses": losses, "probe": probe.tolist(), "logits": client.forward(probe).tolist()}


if __name__ == "__main__":
    job, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        spec = json.load(f)
    result = {"generate": generate, "train": train}[job](spec)
    print("result " + json.dumps(result), flush=True)
