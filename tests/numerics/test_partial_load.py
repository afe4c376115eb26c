"""``load_blocks`` reads only the tensors of the requested blocks, and says clearly what is wrong."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import peers.model.checkpoint as checkpoint
from peers.model import LocalModel, ModelConfig, StageBlocks, load_blocks, load_client_parts, make_tiny_model


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture
def reads(monkeypatch) -> dict[str, list[str]]:
    """Record every (file -> tensor names) the checkpoint reader touches."""
    log: dict[str, list[str]] = {}

    class Recording:
        def __init__(self, path: str, **kw) -> None:
            self.name = path.rsplit("/", 1)[-1]
            self.inner = safe_open(path, **kw)
            log.setdefault(self.name, [])

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key: str) -> torch.Tensor:
            log[self.name].append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(checkpoint, "safe_open", Recording)
    return log


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quarter_of_blocks_is_quarter_of_the_bytes(family: str, tmp_path) -> None:
    path = make_tiny_model(tmp_path / family, family=family, num_layers=8)
    cfg = ModelConfig.from_dir(path)
    part, full = load_blocks(path, 2, 4), load_blocks(path, 0, 8)
    assert isinstance(part, StageBlocks) and (part.start, part.end) == (2, 4) and len(part) == 2
    assert 0.2 < _nbytes(part) / _nbytes(full) < 0.3
    assert sum(p.numel() for p in part[0].parameters()) == cfg.block_param_count
    assert [b.layer_idx for b in part] == [2, 3]
    for a, b in zip(part.state_dict().values(), full[2:4].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not any(p.requires_grad for p in part.parameters()) and not part.training


def test_reads_only_the_requested_tensors(tmp_path, reads) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=8, shards=5)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    blocks = load_blocks(path, 2, 4)
    read = [k for keys in reads.values() for k in keys]
    expected = {k for k in index if re.match(r"model\.layers\.[23]\.", k)}
    assert sorted(read) == sorted(expected)  # each needed tensor once, nothing else
    assert set(reads) == {index[k] for k in expected}  # only the shards holding them were opened
    assert len(reads) < 5
    stored = load_file(path / index["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(blocks[1].mlp.up_proj.weight, stored["model.layers.3.mlp.up_proj.weight"])

    reads.clear()
    emb, head = load_client_parts(path)
    read = {k for keys in reads.values() for k in keys}
    assert read == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def test_stage_chain_equals_local_model(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=8)
    local = LocalModel.from_dir(path)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7)[None]
    with torch.no_grad():
        ref, _ = local(ids)
        h = local.embedding.embed(ids, pos)
        for a, b in [(0, 3), (3, 4), (4, 8)]:
            h, kv = load_blocks(path, a, b)(h, pos)
            assert len(kv) == b - a
        assert torch.allclose(local.head.head(h), ref, atol=1e-5)


def test_dtype_and_device(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=2)
    blocks = load_blocks(path, 0, 1, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in blocks.parameters()} == {torch.bfloat16}
    h, (k, v) = blocks[0](torch.randn(1, 3, 64, dtype=torch.bfloat16), torch.arange(3)[None])
    assert h.dtype == torch.bfloat16 and k.shape == (1, 2, 3, 16)


@pytest.mark.parametrize("start, end", [(-1, 2), (0, 9), (4, 4), (5, 3)])
def test_out_of_range(start: int, end: int, tmp_path) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=8)
    with pytest.raises(ValueError, match=r"not within the model's 8 blocks"):
        load_blocks(path, start, end)


def test_missing_tensor(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=4)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    assert len(load_blocks(path, 0, 3)) == 3  # blocks that do not need it still load
    msg = r"lacks tensor model\.layers\.3\.mlp\.up_proj\.weight: is it a complete Hugging Face folder\?"
    with pytest.raises(ValueError, match=msg):
        load_blocks(path, 2, 4)


def test_missing_shard_and_missing_weights(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=4, shards=3)
    (path / "model-00003-of-00003.safetensors").unlink()
    load_blocks(path, 0, 1)
    with pytest.raises(ValueError, match="lacks shard model-00003-of-00003"):
        load_client_parts(path)
    for f in path.glob("model*"):
        f.unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_blocks(path, 0, 1)
    with pytest.raises(ValueError, match="no config.json"):
        load_blocks(tmp_path, 0, 1)


def test_config_that_does_not_fit_the_weights(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "m", num_layers=2)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    with pytest.raises(ValueError, match="do not fit the config"):
        load_blocks(path, 0, 1)
