"""The RPC declarations: hivemind serves only the unary ``rpc_info``; the stream is our own framed handler."""

from __future__ import annotations

import pytest

from peers.server.handler import StageHandler
from peers.wire.service import INFERENCE_HANDLE, StageService


@pytest.mark.parametrize("cls", [StageService, StageHandler])
def test_hivemind_sees_one_unary_rpc(cls):
    cls._collect_rpc_handlers()
    kinds = {h.method_name: (h.stream_input, h.stream_output) for h in cls._rpc_handlers}
    assert kinds == {"rpc_info": (False, False)}


def test_handle_names_do_not_depend_on_the_subclass():
    assert StageHandler._get_handle_name(None, "rpc_info") == StageService._get_handle_name(None, "rpc_info")
    assert INFERENCE_HANDLE == StageService._get_handle_name(None, "rpc_inference")
