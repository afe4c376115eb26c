"""GraphStage (issue 18): a graph cut into stages run one after another equals the whole model, forward and
training (5 AdamW steps with per-stage optimizers, BatchNorm running stats included), bit for bit in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from peers.model.graph.autodiff import train_backward, train_forward
from peers.model.graph.stage import GraphStage, shared_parameters, split_graph, sum_shared_grads


@pytest.fixture(scope="module")
def resnet_graph(resnet50_graph):
    return resnet50_graph


def _staged_step(stages, inputs, loss_fn):
    """Forward through the stages as separate peers would (``train_forward``: each input a fresh leaf), the loss,
    then ``train_backward`` in reverse passing every crossing edge's gradient by name; returns (loss, logits)."""
    acts, saved = inputs, []
    for stage in stages:
        acts, kept = train_forward(stage, acts)
        saved.append(kept)
    (name,) = acts
    logits = acts[name].requires_grad_()
    loss = loss_fn(logits)
    loss.backward()
    grads = {name: logits.grad}
    for stage, kept in zip(reversed(stages), reversed(saved), strict=True):
        grads = train_backward(stage, kept, grads)
    return loss, logits


def test_resnet50_in_three_stages_trains_like_one_process(resnet_graph):
    graph = resnet_graph
    n = len(graph.order)
    reference = copy.deepcopy(graph.gm).train()
    stages = split_graph(graph, [n // 3, 2 * n // 3])
    keys = [set(s.module.state_dict()) for s in stages]
    assert set().union(*keys) == set(reference.state_dict()) and sum(map(len, keys)) == len(reference.state_dict())
    assert [s.name for s in stages[1].inputs] == [s.name for s in stages[0].outputs]
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opts = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in stages]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen)
        logits_ref = reference(x)
        loss_ref = F.cross_entropy(logits_ref, y)
        loss_ref.backward()
        loss, logits = _staged_step(stages, {"x": x}, lambda z, y=y: F.cross_entropy(z, y))
        assert torch.equal(logits, logits_ref) and torch.equal(loss, loss_ref)
        staged_grads = {k: p.grad for s in stages for k, p in s.module.named_parameters()}
        assert all(torch.equal(staged_grads[k], p.grad) for k, p in reference.named_parameters())
        for opt in [opt_ref, *opts]:
            opt.step()
            opt.zero_grad()
    staged = {k: v for s in stages for k, v in s.module.state_dict().items()}
    assert all(torch.equal(staged[k], v) for k, v in reference.state_dict().items())  # running stats too
    reference.eval()
    for s in stages:
        s.eval()
    x = torch.randn(2, 3, 32, 32, generator=gen)
    with torch.no_grad():
        acts = {"x": x}
        for s in stages:
            acts = s(acts)
        assert torch.equal(acts["fc"], reference(x))


def test_a_wrong_edge_is_refused_with_its_name(resnet_graph):
    stage = GraphStage(resnet_graph, 10, 40)
    good = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in stage.inputs}
    assert set(stage(good)) == {s.name for s in stage.outputs}
    first = stage.inputs[0]
    with pytest.raises(ValueError, match=r"takes edges .*missing \['" + first.name):
        stage({k: v for k, v in good.items() if k != first.name})
    with pytest.raises(ValueError, match=r"unexpected \['bogus'\]"):
        stage({**good, "bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match=f"edge '{first.name}' expects .* got .*float64"):
        stage({**good, first.name: good[first.name].double()})
    with pytest.raises(ValueError, match=f"edge '{first.name}' expects"):
        stage({**good, first.name: good[first.name][:1]})
    with pytest.raises(ValueError, match="not a non-empty range"):
        GraphStage(resnet_graph, 5, 5)


def test_a_wrong_gradient_is_refused_before_anything_is_accumulated(resnet_graph):
    stage = GraphStage(resnet_graph, 10, 40)
    inputs = {s.name: torch.randn(s.shape) for s in stage.inputs}
    outputs, saved = train_forward(stage, inputs)
    good = {k: torch.ones_like(v) for k, v in outputs.items()}
    name = next(iter(good))
    bad = [({**good, "bogus": torch.ones(1)}, r"no gradient to take for edges \['bogus'\]"),
           ({**good, name: good[name][:1]}, f"edge '{name}' expects"),
           ({**good, name: good[name] * float("nan")}, f"gradient of edge '{name}' holds NaN")]
    for grads, message in bad:
        with pytest.raises(ValueError, match=message):
            train_backward(stage, saved, grads)
        assert all(p.grad is None for p in stage.parameters())
    assert set(train_backward(stage, saved, good)) == {s.name for s in stage.inputs}


def test_an_input_written_in_place_is_copied_first(resnet_graph):
    """A cut just before ``ReLU(inplace=True)``: the received tensor is a leaf that needs a gradient, which an
    in-place op may not write; the stage writes into a copy and leaves the caller's tensor as it was."""
    cut = resnet_graph.order.index("relu")
    stage = GraphStage(resnet_graph, cut, cut + 1)
    x = torch.randn(stage.inputs[0].shape).requires_grad_()
    before = x.detach().clone()
    out = stage({"bn1": x})
    out[stage.outputs[0].name].sum().backward()
    assert torch.equal(x.detach(), before) and torch.equal(x.grad != 0, before > 0)


def test_gpt2_from_transformers_in_three_stages_trains_like_one_process(gpt2_graph):
    """transformers' GPT-2 traced by export, cut in 3: logits, losses and every gradient equal one process for 5
    AdamW steps; the tied wte/lm_head (stages 0 and 2) get their two gradients summed before the steps."""
    graph = gpt2_graph
    cuttable = [c for c in range(1, len(graph.order)) if graph.cuttable(c)]
    cuts = [cuttable[len(cuttable) // 3], cuttable[2 * len(cuttable) // 3]]
    shared = shared_parameters(graph, cuts)
    assert len(shared) == 1 and list(shared[0]) == [0, 2] and "model.lm_head.weight" in shared[0].values()
    reference = copy.deepcopy(graph.gm)
    stages = split_graph(graph, cuts)
    opts = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in [reference, *stages]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, 259, (2, 8), generator=gen)
        logits_ref = reference(ids)
        loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, 272), ids[:, 1:].reshape(-1))
        loss_ref.backward()
        loss, logits = _staged_step(stages, {graph.inputs[0]: ids}, lambda z, ids=ids: F.cross_entropy(
            z[:, :-1].reshape(-1, 272), ids[:, 1:].reshape(-1)))
        assert torch.equal(logits, logits_ref) and torch.equal(loss, loss_ref)
        sum_shared_grads(stages, shared)
        staged_grads = {k: p.grad for s in stages for k, p in s.module.named_parameters()}
        every_name = dict(reference.named_parameters(remove_duplicate=False))  # the tied weight under both names
        assert len(staged_grads) == len(list(reference.parameters()))
        assert all(torch.equal(g, every_name[k].grad) for k, g in staged_grads.items())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    (first, last) = (stages[i].module.get_parameter(name) for i, name in shared[0].items())
    assert torch.equal(first, last)
