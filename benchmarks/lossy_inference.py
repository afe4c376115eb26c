"""Lossy inference: what each codec (``ClientConfig.compression``) does to logits, greedy tokens and link bytes.

    python benchmarks/lossy_inference.py [--codecs none,fp16,bf16,int8,topk:0.5/fp16] [--topologies chain,star]
                                         [--prompts 4] [--new 32] [--out FILE] [--workdir DIR]

One local swarm of real peers on 127.0.0.1 (tiny Llama, hidden 256, 8 blocks, fp32, blocks 0:4 and 4:8 on two
peers, encrypted streams), one client per topology, its codec switched between runs. For each topology and codec,
side by side in one run:

* logits of ``--prompts`` prompts of 16 tokens (one forward through the swarm) against the exact ones (codec
  ``none``, which equals one process bit for bit): max and mean absolute error, and the max relative to the largest
  logit;
* greedy generation of ``--new`` tokens from each prompt (8 tokens): tokens that differ from the exact generation,
  and the first position where one does (``null``: none differs);
* bytes on the client's link per generation (every frame both ways, ``PeerStream`` counters), and their ratio to
  ``none``'s.

JSON on stdout and in ``--out`` (default ``benchmarks/results/lossy_inference.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import report

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel, make_tiny_model
from swarm.compression import Codec

MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=688)
SPANS = ("0:4", "4:8")
FORWARD_TOKENS, PROMPT = 16, 8
RESULTS = Path(__file__).resolve().parent / "results" / "lossy_inference.json"


def link_bytes(client: SwarmClient) -> int:
    return sum(s.bytes_sent + s.bytes_received for s in client._links._streams.values())


def use(client: SwarmClient, codec: str) -> None:
    """Switch the client's codec (sessions read ``config.codec`` at each step; nothing else depends on it)."""
    client.config = dataclasses.replace(client.config, compression=codec)


def measure(client: SwarmClient, codec: str, forward_ids: torch.Tensor, prompts: list[torch.Tensor], new: int,
            exact: dict | None) -> dict:
    use(client, codec)
    logits = client.forward(forward_ids).float()
    tokens, sent = [], []
    for ids in prompts:
        before = link_bytes(client)
        tokens.append(client.generate(ids, new)[0, PROMPT:].tolist())
        time.sleep(0.1)  # the session's close goes without a reply
        sent.append(link_bytes(client) - before)
    out: dict = {"logits": logits, "tokens": tokens, "link_bytes_per_generation": sum(sent) / len(sent)}
    if exact is not None:
        error = (logits - exact["logits"]).abs()
        changed = [sum(a != b for a, b in zip(got, want, strict=True))
                   for got, want in zip(tokens, exact["tokens"], strict=True)]
        firsts = [next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
                  for got, want in zip(tokens, exact["tokens"], strict=True)]
        out["report"] = {
            "logit_max_abs_error": float(error.max()),
            "logit_mean_abs_error": float(error.mean()),
            "logit_max_error_over_max_logit": float(error.max() / exact["logits"].abs().max()),
            "tokens_changed": sum(changed),
            "tokens_total": len(prompts) * new,
            "tokens_changed_per_prompt": changed,
            "first_changed_position": [f for f in firsts],
            "link_bytes_per_generation": round(out["link_bytes_per_generation"]),
            "link_bytes_over_none": round(out["link_bytes_per_generation"] / exact["link_bytes_per_generation"], 3),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="none,fp16,bf16,int8,topk:0.5/fp16")
    parser.add_argument("--topologies", default="chain,star")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    codecs = [str(Codec.parse(c)) for c in args.codecs.split(",")]
    if "none" in codecs:
        codecs.remove("none")
    topologies = args.topologies.split(",")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lossy_inference_"))
    model_dir = make_tiny_model(workdir / "llama", seed=0, **MODEL)
    g = torch.Generator().manual_seed(0)
    forward_ids = torch.randint(0, 256, (args.prompts, FORWARD_TOKENS), generator=g)
    prompts = [torch.randint(0, 256, (1, PROMPT), generator=g) for _ in range(args.prompts)]
    local = LocalModel.from_dir(model_dir)
    local_tokens = [local.generate_greedy(ids, args.new)[0, PROMPT:].tolist() for ids in prompts]
    with torch.inference_mode():
        local_logits, _ = local(forward_ids)
    results: dict = {"model": {k: v for k, v in MODEL.items()}, "spans": list(SPANS), "prompts": args.prompts,
                     "forward_tokens": FORWARD_TOKENS, "prompt_tokens": PROMPT, "new_tokens": args.new,
                     "machine": platform.platform(), "topologies": {}}
    with LocalSwarm(workdir / "swarm", update_period=2.0) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=span, wait=False) for span in SPANS]
        for proc in procs:
            swarm.wait_ready(proc)
        for topology in topologies:
            config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), topology=topology)
            with SwarmClient(model_dir, config=config) as client:
                client.wait_for_records(len(SPANS))
                measure(client, "none", forward_ids, prompts[:1], 2, None)  # warm-up: streams, handshakes
                exact = measure(client, "none", forward_ids, prompts, args.new, None)
                figures = {"none": {
                    "logits_equal_one_process": bool(torch.equal(exact["logits"], local_logits.float())),
                    "tokens_equal_one_process": exact["tokens"] == local_tokens,
                    "link_bytes_per_generation": round(exact["link_bytes_per_generation"]),
                }}
                for codec in codecs:
                    figures[codec] = measure(client, codec, forward_ids, prompts, args.new, exact)["report"]
                results["topologies"][topology] = figures
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
