"""``sampling_config``: temperature 0 (or top_p 0) is greedy decoding, as in OpenAI's API."""

from __future__ import annotations

import pytest

from peers.client.generation import SamplingConfig, sampling_config


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0}, {"temperature": 0.0, "top_p": 0.9}, {"top_p": 0}])
def test_greedy(kwargs):
    assert sampling_config(**kwargs, seed=1) == SamplingConfig(seed=1)


def test_sampling():
    assert sampling_config(0.5, top_p=0.9, seed=2) == SamplingConfig(do_sample=True, temperature=0.5, top_p=0.9,
                                                                       seed=2)
    assert sampling_config(top_k=5).do_sample


def test_a_negative_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        sampling_config(-1.0)
