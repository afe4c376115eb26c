"""Operator graphs (issue 18, item 1): registered builders traced locally, the same graph hash in every process,
our ResNet in torchvision's layout, transformers' GPT-2 traced from its own code equal to our block code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from peers.model import LocalModel, make_tiny_model
from peers.model.graph import build_model, check_graph_hash, graph_hash, trace_architecture

ROOT = Path(__file__).resolve().parents[4]
SMALL = {"batch": 2, "image_size": 32}


def test_resnet_has_torchvisions_parameter_counts_and_keys():
    """torchvision's published sizes (1000 classes): the same modules, so its checkpoints load by key."""
    counts = {"resnet18": 11_689_512, "resnet50": 25_557_032}
    for name, count in counts.items():
        with torch.device("meta"):  # shapes only
            model = build_model(name)
        assert sum(p.numel() for p in model.parameters()) == count
    keys = set(model.state_dict())
    assert {"conv1.weight", "bn1.running_mean", "layer1.0.downsample.0.weight", "layer1.0.downsample.1.weight",
            "layer4.2.conv3.weight", "layer4.2.bn3.num_batches_tracked", "fc.weight", "fc.bias"} <= keys


def test_resnet_equals_torchvision():
    """Same weights, same outputs as torchvision's own resnet50 (run only where torchvision imports)."""
    tv = pytest.importorskip("torchvision", reason="torchvision not installed (its wheels pin another torch)")
    ref = tv.models.resnet50(num_classes=10).eval()
    ours = build_model("resnet50", {"num_classes": 10})
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(ours(x), ref(x))


def test_resnet_loads_a_weights_folder_and_refuses_one_that_does_not_fit(tmp_path):
    src = build_model("resnet18", {"num_classes": 10}, seed=7)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = build_model("resnet18", {"num_classes": 10}, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), loaded.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="does not fit resnet18"):
        build_model("resnet18", {"num_classes": 5}, tmp_path)
    with pytest.raises(ValueError, match="no model.safetensors"):
        build_model("resnet18", {}, tmp_path / "..")


def test_unknown_architecture_config_or_input_is_refused():
    known = "known: gpt2, gpt2-blocks, llama, llama-blocks, resnet101"
    with pytest.raises(ValueError, match=f"unknown architecture 'vgg16'.*{known}"):
        trace_architecture("vgg16")
    with pytest.raises(ValueError, match=r"does not take config \['depth'\]"):
        build_model("resnet18", {"depth": 3})
    with pytest.raises(ValueError, match=r"does not take inputs \['seq_len'\]"):
        trace_architecture("resnet18", inputs={"seq_len": 4})
    with pytest.raises(ValueError, match="weights folder .* does not exist"):
        build_model("resnet18", weights="/nonexistent/folder")


def test_cuts_are_crossed_by_skip_connections(resnet50_graph):
    graph = resnet50_graph
    n = len(graph.order)
    assert graph.crossing(0) == graph.inputs == ("x",) and graph.crossing(n) == graph.outputs == ("fc",)
    cut = graph.order.index("layer1_0_conv1") + 1  # inside the first block: the stem's output waits for the skip
    assert graph.crossing(cut) == ("maxpool", "layer1_0_conv1")
    assert all(graph.cuttable(c) for c in range(n + 1))
    assert graph.values["fc"] is not None and graph.values["fc"].shape == (2, 10)


_HASHES = """
import json, sys
from peers.model.graph import graph_hash, trace_architecture
print(json.dumps([graph_hash(trace_architecture("resnet18", {"num_classes": 10}, {"batch": 2, "image_size": 32})),
                  graph_hash(trace_architecture("gpt2", inputs={"batch": 2, "seq_len": 8}, weights=sys.argv[1]))]))
"""


def test_graph_hash_is_the_same_in_another_process_and_changes_with_the_structure(gpt2_dir, gpt2_graph):
    here = [graph_hash(trace_architecture("resnet18", {"num_classes": 10}, SMALL)), graph_hash(gpt2_graph)]
    out = subprocess.run([sys.executable, "-c", _HASHES, str(gpt2_dir)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    others = {graph_hash(trace_architecture("resnet18", {"num_classes": 11}, SMALL)),
              graph_hash(trace_architecture("resnet34", {"num_classes": 10}, SMALL))}
    assert len(others | set(here)) == 4
    check_graph_hash(gpt2_graph, here[1])
    with pytest.raises(ValueError, match=f"graph hash mismatch for gpt2: the trainer traced {here[0][:16]}, this peer"):
        check_graph_hash(gpt2_graph, here[0])


def test_transformers_gpt2_traced_from_its_own_code_equals_our_block_code(gpt2_dir, gpt2_graph):
    """torch.export traces transformers' GPT2LMHeadModel (torch.fx cannot: its forward takes **kwargs and builds
    masks with data-dependent branches); its logits equal our GPT-2 blocks' bit for bit, traced or not."""
    theirs = gpt2_graph
    ours = trace_architecture("gpt2-blocks", inputs={"batch": 2, "seq_len": 8}, weights=gpt2_dir)
    assert graph_hash(theirs) != graph_hash(ours)
    ids = torch.randint(0, 259, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = theirs.gm(ids)
        assert torch.equal(logits, ours.gm(ids))
        assert torch.equal(logits, LocalModel.from_dir(gpt2_dir)(ids)[0])
    assert theirs.values[theirs.outputs[0]] is not None and logits.shape == (2, 8, 272)


def test_transformers_llama_traced_from_its_own_code_equals_our_block_code(tmp_path, gpt2_dir):
    llama_dir = make_tiny_model(tmp_path / "llama", family="llama", num_layers=2, seed=3)
    inputs = {"batch": 2, "seq_len": 8}
    theirs = trace_architecture("llama", inputs=inputs, weights=llama_dir)
    ours = trace_architecture("llama-blocks", inputs=inputs, weights=llama_dir)
    ids = torch.randint(0, 259, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs.gm(ids), ours.gm(ids))
    with pytest.raises(ValueError, match="llama takes a folder of model_type llama or qwen2 or mistral; .* 'gpt2'"):
        build_model("llama", weights=gpt2_dir)
    with pytest.raises(ValueError, match="gpt2-blocks needs a gpt2 folder"):
        build_model("gpt2-blocks", weights=llama_dir)
