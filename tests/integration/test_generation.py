"""Generation through 3 real peers equals local generation, token for token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.client.generation import SamplingConfig, generate_stream, next_tokens
from peers.client.swarm_client import SwarmClient
from peers.client.textgen import TextPieces, eos_ids, load_tokenizer
from peers.model import LocalModel


@pytest.fixture(scope="module")
def gen_swarm(three_hop_swarm) -> LocalSwarm:
    """Three peers for each of the tiny Llama and the tiny GPT-2 (shared with other modules: ``conftest.py``)."""
    return three_hop_swarm


@pytest.fixture(scope="module")
def clients(gen_swarm, llama_dir, gpt2_dir) -> Iterator[dict[str, SwarmClient]]:
    made = {name: SwarmClient(path, initial_peers=gen_swarm.initial_peers)
            for name, path in (("llama", llama_dir), ("gpt2", gpt2_dir))}
    for client in made.values():
        client.wait_for_records(3)
    yield made
    for client in made.values():
        client.close()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_matches_local(clients, family, llama_dir, gpt2_dir):
    model_dir = llama_dir if family == "llama" else gpt2_dir
    client = clients[family]
    assert len(client.records()) == 3
    input_ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    expected = LocalModel.from_dir(model_dir).generate_greedy(input_ids, 32)
    assert client.generate(input_ids, 32).tolist() == expected.tolist()


def test_sampling_matches_local_with_the_same_seed(clients, llama_dir):
    sampling = SamplingConfig(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(6))
    model = LocalModel.from_dir(llama_dir)
    generator = torch.Generator().manual_seed(3)
    tokens, past, out = input_ids, None, [input_ids]
    for _ in range(20):
        logits, past = model(tokens, past=past)
        tokens = next_tokens(logits[:, -1], sampling, generator)[:, None]
        out.append(tokens)
    expected = torch.cat(out, dim=1)
    assert clients["llama"].generate(input_ids, 20, sampling=sampling).tolist() == expected.tolist()


def test_stop_token_ends_generation(clients, llama_dir):
    input_ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(7))
    expected = LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 20)[0, 8:].tolist()
    stop = expected[5]
    first = expected.index(stop)
    got = clients["llama"].generate(input_ids, 20, stop_tokens=[stop])
    assert got[0, 8:].tolist() == expected[: first + 1]


def test_async_stream_from_another_event_loop(clients, llama_dir):
    input_ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(8))
    expected = LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 12)[0, 5:].tolist()

    async def collect():
        return [int(t[0]) async for t in clients["llama"].generate_stream(input_ids, 12)]

    assert asyncio.run(collect()) == expected


def test_concurrent_sessions_are_batched(clients, llama_dir):
    client = clients["llama"]
    prompts = [torch.randint(0, 256, (1, 4 + i), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    model = LocalModel.from_dir(llama_dir)
    before = {r.peer_id: client.info(r.peer_id) for r in client.records()}

    async def run_all():
        async def one(ids):
            return [int(t[0]) async for t in generate_stream(client, ids, 16)]

        return await asyncio.gather(*(one(ids) for ids in prompts))

    results = client.loop.run(run_all())
    for ids, got in zip(prompts, results, strict=True):
        assert got == model.generate_greedy(ids, 16)[0, ids.shape[1]:].tolist()
    batched = False
    for peer_id, old in before.items():
        new = client.info(peer_id)
        steps, batches = new.inference_steps - old.inference_steps, new.inference_batches - old.inference_batches
        assert steps == 6 * 16
        batched |= batches < steps
        assert new.sessions == 0 and new.cache_tokens_free == new.cache_tokens  # closed sessions freed at once
    assert batched, "no peer ran two sessions' steps in one forward"


def test_cli_generate_streams_text(gen_swarm, llama_dir):
    prompt = "Hello swarm"
    ids = torch.tensor([load_tokenizer(llama_dir).encode(prompt).ids])
    expected_ids = LocalModel.from_dir(llama_dir).generate_greedy(ids, 10)[0, ids.shape[1]:].tolist()
    result = subprocess.run(
        [sys.executable, "-m", "peers.cli", "generate", str(llama_dir), "--initial_peers", *gen_swarm.initial_peers,
         "--prompt", prompt, "--max_new_tokens", "10"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )
    assert result.returncode == 0, result.stderr
    tokenizer = load_tokenizer(llama_dir)
    stops = eos_ids(llama_dir, tokenizer)
    decoder, shown = TextPieces(tokenizer), ""
    for token in expected_ids:  # random weights emit arbitrary bytes: whole characters, invalid ones as U+FFFD
        if token in stops:
            break
        shown += decoder.add(token)
    assert result.stdout == prompt + shown + decoder.flush() + "\n"
