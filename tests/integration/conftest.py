"""Real swarms on 127.0.0.1: a bootstrap peer and stage peers as separate processes, stopped by PID.

The session-scoped swarms below are shared by several modules; each stops right after the last test that uses it
(``pytest_runtest_teardown``), not at the end of the session: idle peers and their daemons keep heartbeating and
probing, which costs the rest of the suite CPU time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch.nn.utils import vector_to_parameters

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.training import LocalTrainer
from peers.wire.messages import ParamsFetch

THREE_STAGES = {"stage0": "0:3", "stage1": "3:6", "stage2": "6:8"}
_shared: dict[str, LocalSwarm] = {}  # session swarms started and not yet stopped, by fixture name
_last_user: dict[str, pytest.Item] = {}  # by fixture name: the last collected test that uses it


def _share(name: str, swarm: LocalSwarm) -> LocalSwarm:
    _shared[name] = swarm
    return swarm


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop each shared swarm once the last test that uses it is done (after the module fixtures that use it)."""
    if not _last_user:
        for test in item.session.items:
            for name in getattr(test, "fixturenames", ()):
                _last_user[name] = test
    for name in [n for n in _shared if _last_user.get(n) is item]:
        _shared.pop(name).close()


def _start_stages(swarm: LocalSwarm, model_dir, spans: dict[str, str]) -> dict[str, SwarmProcess]:
    procs = {name: swarm.start_peer(model_dir, block_indices=span, wait=False, name=name)
             for name, span in spans.items()}
    for proc in procs.values():
        swarm.wait_ready(proc)
    return procs


@pytest.fixture(scope="session")
def llama_swarm(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Blocks 0:4 and 4:8 of the tiny Llama on two peers, shared by the modules whose tests leave them as they were
    (each module has its own ``llama_client``)."""
    with _share("llama_swarm", LocalSwarm(tmp_path_factory.mktemp("llama_swarm"), update_period=2.0)) as swarm:
        swarm.start_dht()
        procs = [
            swarm.start_peer(llama_dir, block_indices=span, wait=False, extra=["--max_request_bytes", "2000000"])
            for span in ("0:4", "4:8")
        ]
        for proc in procs:
            swarm.wait_ready(proc)
        yield swarm


@pytest.fixture(scope="session")
def three_hop_swarm(llama_dir, gpt2_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Three peers for each of the tiny Llama (0:3, 3:6, 6:8) and the tiny GPT-2 (0:2, 2:4, 4:6), shared by the
    modules whose tests leave them as they were (sessions closed, nothing trained, nobody killed)."""
    with _share("three_hop_swarm", LocalSwarm(tmp_path_factory.mktemp("three_hop_swarm"), update_period=2.0)) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=span, wait=False)
                 for model_dir, spans in ((llama_dir, ("0:3", "3:6", "6:8")), (gpt2_dir, ("0:2", "2:4", "4:6")))
                 for span in spans]
        for proc in procs:
            swarm.wait_ready(proc)
        yield swarm


@pytest.fixture(scope="session")
def train_stages(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, dict[str, SwarmProcess]]]:
    """Three peers that let the swarm's trainer train blocks 0:3, 3:6 and 6:8 (``THREE_STAGES``), shared by the
    modules whose tests kill none and whose runs have run ids of their own. Earlier runs trained the blocks: a test
    that compares with one process takes the weights they serve now (``served_weights``)."""
    with _share("train_stages", LocalSwarm(tmp_path_factory.mktemp("train_stages"), update_period=1.0,
                                           train=True)) as swarm:
        swarm.start_dht()
        yield swarm, _start_stages(swarm, llama_dir, THREE_STAGES)


def load_served_weights(client: SwarmClient, reference: LocalTrainer, procs: dict[str, SwarmProcess]) -> LocalTrainer:
    """Give ``reference``'s blocks (one stage per peer of ``procs``, in order) exactly the parameters those peers
    serve now, fetched from them."""
    for block, proc in zip(reference.blocks, procs.values(), strict=True):
        stream = client.loop.run(client.peer_stream(proc.peer_id))
        _, flat = client.loop.run(stream.call(ParamsFetch(start=proc.blocks[0], end=proc.blocks[1]), None, 10))
        with torch.no_grad():
            vector_to_parameters(flat, block.parameters())
    return reference


@pytest.fixture
def served_weights() -> Callable[[SwarmClient, LocalTrainer, dict[str, SwarmProcess]], LocalTrainer]:
    return load_served_weights


@pytest.fixture(scope="module")
def llama_client(llama_swarm, llama_dir) -> Iterator[SwarmClient]:
    client = SwarmClient(llama_dir, initial_peers=llama_swarm.initial_peers)
    client.wait_for_records(2)
    yield client
    client.close()


@pytest.fixture
def fresh_swarm(tmp_path) -> Iterator[LocalSwarm]:
    """An empty swarm (bootstrap peer only) for tests that kill or add peers; its peers allow its trainer."""
    with LocalSwarm(tmp_path, update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        yield swarm
