"""Token generation on the client: sampling (pure) and the loop that feeds an ``InferenceSession``."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import torch

from peers.client.node import ClientNode


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen. ``do_sample=False`` or ``temperature=0`` is greedy decoding."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probability reaches p
    seed: int | None = None  # makes sampling reproducible

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN fails too
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def samples(self) -> bool:
        """False for greedy decoding: ``do_sample=False``, or temperature 0 (the limit of sampling as it cools)."""
        return self.do_sample and self.temperature > 0


def sampling_config(temperature: float | None = None, *, top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None) -> SamplingConfig:
    """Greedy when ``temperature`` or ``top_p`` is 0 (as in OpenAI's API), or when nothing asks for sampling;
    else sampling at ``temperature`` (default 1) with ``top_k`` / ``top_p``."""
    if temperature == 0 or top_p == 0 or (temperature is None and top_k is None and top_p is None):
        return SamplingConfig(seed=seed)
    return SamplingConfig(do_sample=True, temperature=1.0 if temperature is None else temperature, top_k=top_k,
                          top_p=top_p, seed=seed)


def next_tokens(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[batch, vocab]``."""
    if not config.samples:
        return logits.argmax(-1)
    logits = logits.float() / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= config.top_p  # tokens after the first that reach top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


async def generate_stream(
    client: ClientNode,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_tokens: Sequence[int] = (),
) -> AsyncGenerator[torch.Tensor, None]:
    """Yield the next token of every row (``[batch]``) as soon as it is chosen.

    Rows that produced a stop token keep yielding that token; the stream ends when every row has
    stopped or after ``max_new_tokens``.
    """
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got {list(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    batch, prompt = input_ids.shape
    max_length = prompt + max_new_tokens
    limit = client.model_config.max_position_embeddings
    if max_length > limit:
        raise ValueError(f"prompt + max_new_tokens = {max_length} exceeds the model's {limit} positions")
    generator = None
    if sampling.samples and sampling.seed is not None:
        generator = torch.Generator().manual_seed(sampling.seed)
    stops = torch.tensor(list(stop_tokens), dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool)
    async with client.inference_session(max_length=max_length, batch_size=batch) as session:
        tokens, position = input_ids.to(client.device), 0
        for _ in range(max_new_tokens):
            positions = torch.arange(position, position + tokens.shape[1], device=client.device).expand_as(tokens)
            with torch.inference_mode():
                hidden = client.embedding(tokens, positions)
            out = await session.step(hidden)
            with torch.inference_mode():
                logits = client.head(out[:, -1:].to(client.device, client.dtype))[:, -1]
            position += tokens.shape[1]
            chosen = next_tokens(logits, sampling, generator).cpu()
            chosen = torch.where(finished, stops[0] if len(stops) else chosen, chosen)
            yield chosen
            if len(stops):
                finished |= torch.isin(chosen, stops)
                if finished.all():
                    return
            tokens = chosen[:, None].to(client.device)
