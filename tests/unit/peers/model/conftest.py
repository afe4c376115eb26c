"""One traced ResNet-50 (10 classes, batch 2 of 32x32 images, train mode) for the graph tests: building it
(initialising 23 M parameters) and tracing take seconds. Tests copy what they change (stages own copies)."""

from __future__ import annotations

import pytest

from peers.model.graph import OpGraph, trace_architecture

RESNET_INPUTS = {"batch": 2, "image_size": 32}


@pytest.fixture(scope="session")
def resnet50_graph() -> OpGraph:
    return trace_architecture("resnet50", {"num_classes": 10}, RESNET_INPUTS, train=True)
