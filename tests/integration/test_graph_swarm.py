"""Operator graphs through the swarm (issue 18 item 4): ResNet-50 cut into 3 stages on 3 ``swarm peer --graph``
processes, trained by a ``GraphTrainer`` in a star. The forward and 5 two-phase steps (2 micro-batches each, both in
flight) equal one process bit for bit (fp32, no compression: losses and every weight and BatchNorm statistic); an
unknown architecture, a graph-hash mismatch, a wrong edge tensor and an incomplete step are refused with a message,
change nothing, and the peer keeps serving. Small images (32 px) and micro-batches of 2 keep it within seconds."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from peers.cli.launch import LocalSwarm
from peers.core.config import SwarmConfig
from peers.model.graph.swarm_graph import GraphSpec
from peers.model.graph.trace import EdgeSpec
from peers.trainer.graph_trainer import GraphTrainer
from peers.wire.errors import RequestError
from peers.wire.messages import GraphApply, GraphForward, GraphOpen, ParamsPush

SPEC = GraphSpec("resnet50", {"num_classes": 10}, {"batch": 2, "image_size": 32})
FLAGS = ["--graph_config", "num_classes=10", "--graph_inputs", "batch=2,image_size=32"]
OPTIM = {"lr": 1e-3, "weight_decay": 0.01}


@pytest.fixture(scope="module")
def graph_swarm(tmp_path_factory) -> Iterator[tuple[LocalSwarm, GraphTrainer]]:
    """Three graph peers (equal thirds of ResNet-50's nodes) and the trainer they allow."""
    n = len(SPEC.trace().order)
    bounds = [0, n // 3, 2 * n // 3, n]
    with LocalSwarm(tmp_path_factory.mktemp("graph_swarm"), update_period=2.0, train=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_graph_peer("resnet50", nodes=f"{a}:{b}", extra=_checkpointed(swarm), wait=False,
                                        name=f"graph{i}")
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
        for proc in procs:
            swarm.wait_graph_ready(proc)
        with GraphTrainer(SPEC, swarm.trainer_config(), optim=OPTIM, run_id="graph-equivalence", in_flight=2,
                          request_timeout=30) as trainer:
            trainer.start()
            yield swarm, trainer


def _checkpointed(swarm: LocalSwarm) -> list[str]:
    return [*FLAGS, "--checkpoint_dir", str(swarm.workdir / "checkpoints")]


def _reference_step(reference: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    micro: list[tuple[torch.Tensor, torch.Tensor]], loss_fn=F.cross_entropy) -> list[torch.Tensor]:
    """One process's step over ``micro``: each micro-batch's loss (``loss_fn(logits, targets)``)."""
    losses = []
    for x, y in micro:
        loss = loss_fn(reference(x), y)
        (loss / len(micro)).backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad()
    return losses


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The reference computes with one thread, like the peers (``--num_threads 1``): a convolution's sums may be
    ordered differently with more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(trainer: GraphTrainer) -> torch.nn.Module:
    """One process holding exactly what the peers hold now (a tied weight's alias is loaded through its twin)."""
    model = copy.deepcopy(trainer.graph.gm)
    missing, unexpected = model.load_state_dict(trainer.fetch_state(), strict=False)
    assert not unexpected and set(missing) <= {"model.transformer.wte.weight"}
    return model


def test_forward_equals_one_process(graph_swarm, one_thread):
    _, trainer = graph_swarm
    n = len(trainer.graph.order)
    assert [(s.start, s.end) for s in trainer.stages] == [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    reference = _reference(trainer).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(x)
    assert torch.equal(trainer.forward(x), expected)
    assert torch.equal(trainer.classify(x), expected.argmax(-1))


def test_five_steps_equal_one_process(graph_swarm, one_thread):
    """Losses, then every weight, AdamW-updated, and every BatchNorm statistic, bit for bit."""
    _, trainer = graph_swarm
    reference = _reference(trainer).train()
    optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)  # type: ignore[arg-type]
    assert trainer.step == 0, "this test's run starts at step 0 (run it once per swarm)"
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        micro = [(torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen))
                 for _ in range(2)]
        losses = trainer.train_step(micro)
        expected = _reference_step(reference, optimizer, micro)
        assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True)), (losses, expected)
    assert trainer.step == 5
    state = trainer.fetch_state()
    assert set(state) == set(reference.state_dict())
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_bad_requests_are_refused_and_change_nothing(graph_swarm, swarm_cli):
    swarm, trainer = graph_swarm
    first = trainer.stages[0]
    stream = trainer.stream(first.peer_id)
    before = trainer.fetch_state()
    x = {"x": torch.randn(2, 3, 32, 32)}

    def forward(tensors, specs, **fields):
        request = GraphForward(**{"arch": "resnet50", "graph_hash": trainer.graph_hash, "start": first.start,
                                  "end": first.end, **fields})
        bundle_hash = fields.get("graph_hash", trainer.graph_hash)

        async def call():
            return await stream.submit_bundle(request, tensors, specs, first.outputs, bundle_hash, 30)
        return trainer.run(call())

    with pytest.raises(RequestError, match="unknown architecture 'resnet9000'.*known: .*resnet50"):
        forward(x, first.inputs, arch="resnet9000")
    with pytest.raises(RequestError, match="graph hash mismatch"):
        forward(x, first.inputs, graph_hash="00" * 32)
    small = EdgeSpec("x", (2, 3, 16, 16), torch.float32)
    with pytest.raises(RequestError, match=r"edge 'x' expects \[2, 3, 32, 32\] torch.float32, got \[2, 3, 16, 16\]"):
        forward({"x": torch.randn(2, 3, 16, 16)}, (small,))
    with pytest.raises(RequestError, match=r"missing \['x'\], unexpected \['y'\]"):
        forward({"y": torch.randn(2, 3, 32, 32)}, (EdgeSpec("y", (2, 3, 32, 32), torch.float32),))
    with pytest.raises(RequestError, match="serves nodes 0:"):
        trainer.run(stream.call(GraphOpen(run_id="other", arch="resnet50", graph_hash=trainer.graph_hash, start=1,
                                          end=first.end), None, 30))
    with pytest.raises(RequestError, match="the trainer sent 1 micro-batches, this stage holds 0"):
        trainer.run(stream.call(GraphApply(run_id=trainer.run_id, micro_batches=1), None, 30))
    _, out = forward(x, first.inputs)  # still serving, and nothing changed
    assert out is not None and set(out) == {s.name for s in first.outputs}
    after = trainer.fetch_state()
    assert all(torch.equal(before[k], v) for k, v in after.items())
    refused = swarm_cli("peer", "--graph", "resnet9000", "--graph_nodes", "0:3", "--initial_peers",
                        *swarm.initial_peers)
    assert refused.returncode == 2 and "unknown architecture 'resnet9000'" in refused.stderr
    with GraphTrainer(SPEC, SwarmConfig(initial_peers=tuple(swarm.initial_peers)), run_id="stranger") as stranger:
        with pytest.raises(RequestError, match="not allowed to train here: this peer trains for trainer"):
            stranger.start()  # a fresh identity, which the peers' --trainers does not name
        assert torch.equal(stranger.forward(x["x"]), trainer.forward(x["x"]))  # inference is open to anyone admitted


def test_int8_edges_stay_close_and_other_codecs_are_refused(graph_swarm, one_thread):
    """Protects: ``GraphTrainer(compression="int8")``: every cut's tensors travel int8 both ways (forward outputs
    and gradients), so the outputs (eval mode) differ from the exact ones but stay close, and a step trains every
    stage on them; top-k or
    an unknown codec is refused (by the trainer, and by a peer for a raw request), and the peer keeps serving."""
    swarm, trainer = graph_swarm
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    exact = trainer.forward(x)
    y = torch.randint(0, 10, (2,), generator=torch.Generator().manual_seed(4))
    expected = F.cross_entropy(_reference(trainer).train()(x), y).item()  # the first micro-batch, in train mode
    with pytest.raises(ValueError, match="graph edges travel with one of none, fp16, bf16, int8"):
        GraphTrainer(SPEC, swarm.trainer_config(), compression="topk:0.1")
    with GraphTrainer(SPEC, swarm.trainer_config(), optim=OPTIM, run_id="graph-int8", in_flight=2,
                      request_timeout=30, compression="int8") as lossy:
        coded = lossy.forward(x)
        assert not torch.equal(coded, exact)
        assert (coded - exact).abs().max() <= 0.05 * exact.abs().max(), (coded, exact)
        lossy.start()
        before = lossy.fetch_state()
        loss = lossy.train_step([(x, y), (x, y)])[0].item()
        # a random ResNet in train mode on 2 images is chaotic (int8 of the input alone moves this loss by 9%): the
        # step's loss is the coded one, finite, not the exact one
        assert math.isfinite(loss) and loss != expected, (loss, expected)
        after = lossy.fetch_state()
        assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
        assert not torch.equal(after["fc.weight"], before["fc.weight"])  # the coded gradients reached every stage
        assert not torch.equal(after["conv1.weight"], before["conv1.weight"])
        first = lossy.stages[0]
        request = GraphForward(arch="resnet50", graph_hash=lossy.graph_hash, start=first.start, end=first.end,
                               compression="zip")

        stream = lossy.stream(first.peer_id)

        async def call():
            return await stream.submit_bundle(request, {"x": x}, first.inputs, first.outputs, lossy.graph_hash, 30)
        with pytest.raises(RequestError, match="graph edges travel with one of"):
            lossy.run(call())
        assert torch.equal(lossy.forward(x), lossy.forward(x))  # still serving


def test_a_restarted_stage_resumes_from_its_checkpoint(graph_swarm, one_thread):
    """Protects: with ``--checkpoint_dir`` and ``checkpoint_every``, a stage peer stopped after 2 steps and started
    again resumes the run from its checkpoint (weights, AdamW state, BatchNorm statistics, step): the trainer finds
    every stage at step 2, and the third step equals one process's bit for bit. (Last of the ResNet tests: it
    replaces a peer the module's trainer used.)"""
    swarm, trainer = graph_swarm
    reference = _reference(trainer).train()
    optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    steps = [[(torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen))
              for _ in range(2)] for _ in range(3)]
    with GraphTrainer(SPEC, swarm.trainer_config(), optim=OPTIM, run_id="graph-resume", in_flight=2,
                      request_timeout=30, checkpoint_every=1) as run:
        run.start()
        assert run.step == 0
        for micro in steps[:2]:
            run.train_step(micro)
            _reference_step(reference, optimizer, micro)
        middle = next(p for p in swarm.processes if p.name == "graph1")
        nodes = "{}:{}".format(*middle.blocks)
        middle.stop(timeout=15)
        swarm.processes.remove(middle)
        swarm.start_graph_peer("resnet50", nodes=nodes, extra=_checkpointed(swarm), name="graph1-restarted")
        run.start()  # finds the stages again and re-opens the run on each
        assert run.step == 2, "every stage resumed step 2"
        assert run.stages[1].peer_id != middle.peer_id
        losses = run.train_step(steps[2])
        expected = _reference_step(reference, optimizer, steps[2])
        assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True)), (losses, expected)
        state = run.fetch_state()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_replicas_of_a_stage_share_its_micro_batches_and_average(graph_swarm, one_thread):
    """Protects graph replicas (``peers.server.graph_replicas``): a second peer serving the middle nodes joins a new
    run as a replica, copies the first replica's weights, takes every other micro-batch (its gradient scaled to its
    own mean) and the two average their weights after every step. With each step's two micro-batches equal, that is
    one process's step exactly: losses and every parameter equal bit for bit (not the replicated stage's BatchNorm
    statistics: each replica ran one of the two forwards). With different micro-batches the replicas stay
    bit-identical. Bad replica settings and a push from a stranger are refused and change nothing. (After the
    restart test: it adds a peer.)"""
    swarm, _ = graph_swarm
    middle = next(p for p in swarm.processes if p.name.startswith("graph1"))
    swarm.start_graph_peer("resnet50", nodes="{}:{}".format(*middle.blocks), extra=FLAGS, name="graph1-replica")
    with GraphTrainer(SPEC, swarm.trainer_config(), optim=OPTIM, run_id="graph-replicas", in_flight=2,
                      request_timeout=30) as run:
        deadline = time.monotonic() + 30
        run.start()
        while len(run.replicas[1]) < 2 and time.monotonic() < deadline:  # until the new peer's record is seen
            time.sleep(1)
            run.start()
        assert [len(group) for group in run.replicas] == [1, 2, 1]
        first, second = run.replicas[1]
        copied = run.fetch_replica_state(second)
        assert all(torch.equal(copied[k], v) for k, v in run.fetch_replica_state(first).items()), "not copied"
        reference = _reference(run).train()
        optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(2)
        for _ in range(2):
            x, y = torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen)
            losses = run.train_step([(x, y), (x, y)])
            expected = _reference_step(reference, optimizer, [(x, y), (x, y)])
            assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True)), (losses, expected)
        params = {k: v.detach() for k, v in reference.named_parameters()}
        state = run.fetch_state()
        assert all(torch.equal(state[k], v) for k, v in params.items())
        second_state = run.fetch_replica_state(second)
        assert all(torch.equal(second_state[k], params[k]) for k in second_state if k in params)

        stream = run.stream(second.peer_id)

        def open_second(**changes):
            request = dict(run_id="graph-replicas", arch="resnet50", graph_hash=run.graph_hash, start=second.start,
                           end=second.end, optim=OPTIM, replicas=[first.peer_id], source="")
            return run.run(stream.call(GraphOpen(**{**request, **changes}), None, 30))

        with pytest.raises(RequestError, match="source of the weights .* must be another replica"):
            open_second(source=run.stages[0].peer_id)
        with pytest.raises(RequestError, match="average_every must be in"):
            open_second(average_every=0)
        with pytest.raises(RequestError, match="is not a replica of this span"):
            run.run(stream.call(ParamsPush(run_id="graph-replicas", round=2), torch.zeros(copied_size(copied)), 30))
        gen = torch.Generator().manual_seed(3)
        run.train_step([(torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen))
                        for _ in range(2)])
        assert run.step == 3
        a, b = run.fetch_replica_state(first), run.fetch_replica_state(second)
    assert all(torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point()), "the replicas drifted apart"
    assert any(not torch.equal(a[k], params[k]) for k in a if k in params), "the third step changed nothing"


def copied_size(state: dict[str, torch.Tensor]) -> int:
    """Values a replica of this stage averages: its parameters and floating-point buffers."""
    return sum(v.numel() for v in state.values() if v.is_floating_point())


@pytest.fixture(scope="module")
def gpt2_swarm(gpt2_dir, tmp_path_factory) -> Iterator[GraphTrainer]:
    """transformers' GPT-2 (the tiny one, traced from its own code by ``torch.export``) in 3 equal stages: its tied
    ``wte``/``lm_head`` is held by the first and the last."""
    spec = GraphSpec("gpt2", {}, {"batch": 2, "seq_len": 8}, gpt2_dir)
    flags = ["--graph_inputs", "batch=2,seq_len=8", "--weights", str(gpt2_dir), "--graph_split", "equal"]
    with LocalSwarm(tmp_path_factory.mktemp("gpt2_graph_swarm"), update_period=2.0, train=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_graph_peer("gpt2", stage=f"{i}/3", extra=flags, wait=False, name=f"gpt2-{i}")
                 for i in range(3)]
        for proc in procs:
            swarm.wait_graph_ready(proc)
        with GraphTrainer(spec, swarm.trainer_config(), optim=OPTIM, run_id="gpt2-equivalence", in_flight=2,
                          request_timeout=30) as trainer:
            trainer.start()
            yield trainer


def test_gpt2_trains_like_one_process(gpt2_swarm, one_thread):
    """Logits, 5 steps' losses (2 micro-batches each, in flight) and every weight equal one process bit for bit; the
    tied weight's parts are added per micro-batch in one process's order."""
    trainer = gpt2_swarm
    assert [sorted(names) for names in trainer.shared] == [[0, 2]]
    reference = _reference(trainer)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (2, 8), generator=gen)
    assert torch.equal(trainer.forward(ids), reference(ids))
    optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)  # type: ignore[arg-type]
    for _ in range(5):
        micro = [(x, x) for x in (torch.randint(0, 259, (2, 8), generator=gen) for _ in range(2))]
        losses = trainer.train_step(micro)
        expected = _reference_step(reference, optimizer, micro, trainer.loss)
        assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True)), (losses, expected)
    state, reference_state = trainer.fetch_state(), reference.state_dict()
    assert all(torch.equal(v, reference_state[k]) for k, v in state.items())
    assert set(reference_state) - set(state) == {"model.transformer.wte.weight"}  # the tied alias of lm_head
