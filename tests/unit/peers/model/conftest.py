"""One traced ResNet-50 (10 classes, batch 2 of 32x32 images, train mode) and one traced transformers GPT-2 (the
tiny ``gpt2_dir``, batch 2 of 8 tokens) for the graph tests: building and tracing take seconds. Tests copy what
they change (stages own copies)."""

from __future__ import annotations

import pytest

from peers.model.graph import OpGraph, trace_architecture

RESNET_INPUTS = {"batch": 2, "image_size": 32}


@pytest.fixture(scope="session")
def resnet50_graph() -> OpGraph:
    return trace_architecture("resnet50", {"num_classes": 10}, RESNET_INPUTS, train=True)


@pytest.fixture(scope="session")
def gpt2_graph(gpt2_dir) -> OpGraph:
    return trace_architecture("gpt2", inputs={"batch": 2, "seq_len": 8}, weights=gpt2_dir)
