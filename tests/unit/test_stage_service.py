"""The RPC declarations: hivemind must see the tensor RPCs as streams (typing.AsyncIterator annotations)."""

from __future__ import annotations

import pytest

from peers.handler import StageHandler
from peers.protocol import StageService


@pytest.mark.parametrize("cls", [StageService, StageHandler])
def test_tensor_rpcs_are_bidirectional_streams(cls):
    cls._collect_rpc_handlers()
    kinds = {h.method_name: (h.stream_input, h.stream_output) for h in cls._rpc_handlers}
    assert kinds == {"rpc_info": (False, False), "rpc_inference": (True, True)}


def test_handle_names_do_not_depend_on_the_subclass():
    assert StageHandler._get_handle_name(None, "rpc_inference") == StageService._get_handle_name(None, "rpc_inference")
