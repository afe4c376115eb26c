"""Error feedback: top-k with it transmits the whole signal over time; without it, the same values are lost forever."""

from __future__ import annotations

import torch

from swarm.compression.codecs import Codec, decode, encode
from swarm.compression.feedback import ErrorFeedback

TOPK = Codec.parse("topk:0.1/int8")


def sent_over(messages: int, tensor: torch.Tensor, feedback: ErrorFeedback | None) -> torch.Tensor:
    """The sum of what arrives over ``messages`` messages of the same ``tensor``."""
    total = torch.zeros_like(tensor)
    for _ in range(messages):
        encoded = feedback.compress("params", tensor, TOPK) if feedback is not None else encode(tensor, TOPK)
        total += decode(encoded.serialized, max_bytes=1 << 20).tensor
    return total


def test_topk_with_feedback_transmits_the_whole_signal() -> None:
    tensor = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def error(n: int, feedback: ErrorFeedback | None) -> float:
        return float((sent_over(n, tensor, feedback) - n * tensor).norm() / (n * tensor).norm())

    assert error(200, ErrorFeedback()) < 0.05  # the error is one residual, not n of them: it shrinks as 1/n
    assert error(200, ErrorFeedback()) < error(50, ErrorFeedback()) / 2
    assert error(200, None) > 0.5  # plain top-k drops the same 90% of the values every time


def test_residual_is_what_the_codec_lost() -> None:
    feedback = ErrorFeedback()
    tensor = torch.tensor([4.0, -3.0, 0.5, 0.25])
    encoded = feedback.compress("k", tensor, Codec.parse("topk:0.5"))
    assert decode(encoded.serialized, max_bytes=1 << 10).tensor.tolist() == [4.0, -3.0, 0.0, 0.0]
    assert feedback.residuals["k"].tolist() == [0.0, 0.0, 0.5, 0.25]
    again = feedback.compress("k", torch.tensor([0.0, 0.0, 0.0, 0.5]), Codec.parse("topk:0.5"))
    assert decode(again.serialized, max_bytes=1 << 10).tensor.tolist() == [0.0, 0.0, 0.5, 0.75]
    assert feedback.residuals["k"].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_keys_are_separate_and_a_new_shape_starts_afresh() -> None:
    feedback = ErrorFeedback()
    feedback.compress("a", torch.tensor([1.0, 0.1]), Codec.parse("topk:0.5"))
    plain = feedback.compress("b", torch.tensor([1.0, 0.1]), Codec.parse("topk:0.5"))
    assert decode(plain.serialized, max_bytes=64).tensor.tolist() == [1.0, 0.0]  # b has no residual of a
    other_shape = feedback.compress("a", torch.tensor([1.0, 0.1, 0.2]), Codec.parse("none"))
    assert decode(other_shape.serialized, max_bytes=64).tensor.tolist() == torch.tensor([1.0, 0.1, 0.2]).tolist()
    assert feedback.residuals["a"].abs().sum() == 0  # an exact codec leaves nothing behind
    feedback.reset()
    assert not feedback.residuals
