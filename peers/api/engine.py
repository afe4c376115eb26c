"""The generation engine behind ``swarm api`` and ``swarm chat``: text in, text pieces out, through one client.

One ``SwarmClient`` (its node, its encrypted streams to the peers) serves every request; each request is its own
inference session on the peers, which batch the steps of concurrent sessions. ``Engine.stream`` runs on the
client's event loop (``client.loop``): the HTTP server runs there too, ``swarm chat`` iterates it from its thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import torch

from peers.api.chat_template import ChatTemplate
from peers.api.stops import TextStream
from peers.client.generation import SamplingConfig, generate_stream, sampling_config
from peers.client.swarm_client import SwarmClient
from peers.client.textgen import eos_ids, load_tokenizer

END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")  # chat models end a reply with these too


class ContextError(ValueError):
    """The prompt (with the tokens asked for) does not fit in the model's context."""


@dataclass(frozen=True)
class Job:
    """One generation: the prompt's ids and how to continue it."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig
    stops: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    """New text; the last one of a generation has its ``finish_reason`` ("stop" or "length")."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0  # tokens generated so far (the end token included)


class Engine:
    def __init__(self, client: SwarmClient, *, default_max_tokens: int = 256) -> None:
        if default_max_tokens < 1:
            raise ValueError("the default max_tokens must be >= 1")
        self.client, self.default_max_tokens = client, default_max_tokens
        self.model_id = client.model_name
        self.tokenizer = load_tokenizer(client.model_dir)
        self.template = ChatTemplate(client.model_dir)
        extra = [self.tokenizer.token_to_id(name) for name in END_OF_TURN]
        self.stop_ids = tuple(dict.fromkeys([*eos_ids(client.model_dir, self.tokenizer),
                                             *(i for i in extra if i is not None)]))
        self.context = client.model_config.max_position_embeddings
        self.vocab_size = client.model_config.vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], tuple[str, ...]]:
        """The ids that ask for the assistant's reply to ``messages``, and the stop sequences of the format."""
        prompt = self.template.render(messages)
        return self.encode(prompt.text, add_special_tokens=prompt.add_special_tokens), prompt.stops

    def job(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None, temperature: float = 1.0,
            top_p: float = 1.0, seed: int | None = None, stops: Sequence[str] = ()) -> Job:
        """A checked ``Job``: ``ContextError`` if it does not fit; ``max_tokens=None``: the default, clipped to
        what the context leaves; ``temperature`` 0 is greedy."""
        prompt_ids = tuple(int(t) for t in prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        left = self.context - len(prompt_ids)
        if left < 1:
            raise ContextError(f"the prompt has {len(prompt_ids)} tokens: this model's context is {self.context} "
                               f"tokens, with room for at least one new token; shorten the prompt")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, left)
        elif max_tokens > left:
            raise ContextError(f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: together "
                               f"{len(prompt_ids) + max_tokens}, more than this model's context of {self.context} "
                               f"tokens; ask for at most {left} tokens or shorten the prompt")
        sampling = sampling_config(temperature, top_p=None if top_p == 1 else top_p, seed=seed)
        return Job(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, stops=tuple(stops))

    async def stream(self, job: Job) -> AsyncGenerator[Delta, None]:
        """The new text as it comes, cut at an end token or a stop sequence; run it on ``client.loop``."""
        text, count, finish = TextStream(self.tokenizer, job.stops), 0, "length"
        tokens = generate_stream(self.client, torch.tensor([job.prompt_ids]), job.max_tokens, job.sampling,
                                 stop_tokens=self.stop_ids)
        async with contextlib.aclosing(tokens):  # leaving early closes the session on the peers at once
            async for chosen in tokens:
                token, count = int(chosen[0]), count + 1
                if token in self.stop_ids:
                    finish = "stop"
                    break
                piece, stopped = text.push(token)
                if stopped:
                    yield Delta(piece, "stop", count)
                    return
                if piece:
                    yield Delta(piece, None, count)
        rest, stopped = text.finish()
        yield Delta(rest, "stop" if stopped else finish, count)

    async def complete(self, job: Job) -> Delta:
        """The whole text at once (its finish reason and token count)."""
        pieces = [delta async for delta in self.stream(job)]
        return Delta("".join(d.text for d in pieces), pieces[-1].finish_reason, pieces[-1].completion_tokens)
