"""Byte/tokenizer encoding, deterministic TokenBatches, and the locally built stdlib corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.model import make_tiny_model
from peers.training import TokenBatches, builtin_corpus, encode_bytes, encode_with_tokenizer, read_corpus
from peers.training.corpus import build_corpus_text, stdlib_sources


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # shared with test_training_local.py through the session's base temp folder: built once per run
    return builtin_corpus(cache_dir=tmp_path_factory.getbasetemp() / "training-corpus")


def test_encode_bytes_matches_tiny_tokenizer(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=16)
    text = "Hello, wörld!\n\ttabs and ✓ emoji 🚀"
    ids = encode_bytes(text)
    assert ids.dtype == torch.long and ids.tolist() == list(text.encode("utf-8"))
    assert torch.equal(encode_with_tokenizer(model, text), ids)
    assert encode_bytes("").shape == (0,)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        encode_with_tokenizer(tmp_path, text)


def test_token_batches_are_deterministic_windows() -> None:
    tokens = torch.arange(1000)
    a, b, c = (TokenBatches(tokens, seq_len=16, micro_batch=4, seed=s) for s in (7, 7, 8))
    first = [a.next_micro() for _ in range(5)]
    assert all(torch.equal(x, next(b)) for x in first)
    assert not all(torch.equal(x, c.next_micro()) for x in first)
    for batch in first:
        assert batch.shape == (4, 17)
        assert torch.equal(batch - batch[:, :1], torch.arange(17).expand(4, 17))  # contiguous windows
        assert int(batch.max()) < len(a.tokens)  # never from the held-out part
    assert len(a.held_out) == 50 and int(a.held_out[0]) == 950
    windows = a.held_out_windows()
    assert windows.shape == (2, 17) and torch.equal(windows[0], torch.arange(950, 967))
    assert a.held_out_windows(limit=1).shape == (1, 17)
    resumed = TokenBatches(tokens, seq_len=16, micro_batch=4, seed=7)
    resumed.skip(3)
    assert torch.equal(resumed.next_micro(), first[3]) and resumed.drawn == 4


def test_token_batches_refuse_too_little_text() -> None:
    with pytest.raises(ValueError, match="too few for seq_len=64"):
        TokenBatches(torch.arange(100), seq_len=64, micro_batch=2)
    with pytest.raises(ValueError, match="must be 1-D"):
        TokenBatches(torch.zeros(4, 100, dtype=torch.long), seq_len=8, micro_batch=2)


def test_builtin_corpus_is_cached_text(corpus_path: Path) -> None:
    assert corpus_path.is_file() and corpus_path.name.startswith("stdlib-docstrings-")
    mtime = corpus_path.stat().st_mtime_ns
    assert builtin_corpus(cache_dir=corpus_path.parent) == corpus_path
    assert corpus_path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    text = read_corpus(None, cache_dir=corpus_path.parent)
    assert 500_000 < len(text.encode("utf-8")) < 3_000_000
    assert "Return" in text and len(stdlib_sources()) > 50


def test_corpus_text_is_deterministic(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    (root / "json").mkdir(parents=True)
    (root / "json" / "__init__.py").write_text('"""JSON module."""\nif True:\n    def f():\n        """Inner."""\n')
    (root / "argparse.py").write_text('"""Parse args."""\nclass A:\n    """A class."""\n    def m(self):\n'
                                      '        """A method."""\n')
    assert build_corpus_text(root) == "Parse args.\n\nA class.\n\nA method.\n\nJSON module.\n\nInner.\n"
    assert build_corpus_text(root) == build_corpus_text(root)


def test_read_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_corpus(bad)
