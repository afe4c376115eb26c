"""``swarm export``: a short real training run on two stage peers, exported live (fetched from the peers) and from
their checkpoint folders; the export loads in transformers with the swarm's logits, and ``swarm generate`` runs the
trained weights, on the export or live (``--checkpoint``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from peers.cli import commands as cli
from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.client.textgen import TextPieces, eos_ids, load_tokenizer
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel, ModelConfig

transformers = pytest.importorskip("transformers")
STEPS = 3


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "peers.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """Run ``exp`` trained for STEPS steps on peers 0:4 and 4:8 (which checkpoint it), then exported live."""
    workdir = tmp_path_factory.mktemp("export")
    config = workdir / "exp.toml"
    config.write_text(f'model_dir = "{llama_dir}"\nseq_len = 16\nbatch_size = 4\nmicro_batch = 4\nsteps = {STEPS}\n'
                      f'checkpoint_dir = "{workdir / "ckpt"}"\ncheckpoint_every = {STEPS}\n'
                      '[optim]\nlr = 1e-2\nwarmup_steps = 1\nschedule = "constant"\n')
    with LocalSwarm(workdir, update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"stage{i}",
                                  extra=["--checkpoint_dir", str(workdir / f"peer{i}")])
                 for i, span in enumerate(("0:4", "4:8"))]
        for proc in procs:
            swarm.wait_ready(proc)
        join = ["--initial_peers", *swarm.initial_peers]
        _cli("train", str(config), *join, *swarm.trainer_flags(), "--eval_every", "0", "--eval_windows", "1")
        live = _cli("export", str(config), "--out", str(workdir / "live"), *join)
        yield SimpleNamespace(swarm=swarm, config=config, workdir=workdir, join=join, out=workdir / "live",
                              live=live, name=ModelConfig.from_dir(llama_dir).name)


def test_the_export_loads_in_transformers_with_the_swarms_logits(trained, llama_dir):
    out = trained.out
    meta = json.loads((out / "export.json").read_text())
    assert meta["run_id"] == "exp" and meta["step"] == STEPS and len(meta["blocks"]) == 8
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    ids = torch.tensor([list(b"Return the value of x")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(trained.swarm.initial_peers)),
                          model_name=trained.name)
    with torch.no_grad(), SwarmClient(out, config=config) as client:  # the export's embedding + head, peers' blocks
        swarm_logits = client.forward(ids)
        hf_logits = hf(ids).logits
    assert hf.dtype == torch.float32
    torch.testing.assert_close(hf_logits, swarm_logits, rtol=0, atol=1e-5)
    assert torch.equal(LocalModel.from_dir(out).forward(ids)[0], swarm_logits)  # our code: bit-exact
    original = LocalModel.from_dir(llama_dir).forward(ids)[0]
    assert (original - swarm_logits).abs().max() > 1e-2  # trained: not the model folder's weights


def test_the_peers_checkpoint_folders_give_the_same_export(trained, tmp_path, capsys):
    out = tmp_path / "from-folders"
    _cli("export", str(trained.config), "--out", str(out), "--blocks_from", str(trained.workdir / "peer0"),
         str(trained.workdir / "peer1"))
    live, folders = load_file(str(trained.out / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert live.keys() == folders.keys() and all(torch.equal(live[k], folders[k]) for k in live)
    assert cli.main(["export", str(trained.config), "--out", str(out)]) == 2  # refused before any work
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err


def _expected_text(model_dir: Path, prompt: str, new: int) -> str:
    tokenizer = load_tokenizer(model_dir)
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    tokens = LocalModel.from_dir(model_dir).generate_greedy(ids, new)[0, ids.shape[1]:].tolist()
    stops, decoder, text = eos_ids(model_dir, tokenizer), TextPieces(tokenizer), prompt
    for token in tokens:
        if token in stops:
            break
        text += decoder.add(token)
    return text + decoder.flush() + "\n"


def test_generate_runs_the_trained_weights_from_the_export_or_live(trained, llama_dir):
    prompt, new = "def f(x):", 8
    expected = _expected_text(trained.out, prompt, new)  # the trained weights, in one process
    args = ["--prompt", prompt, "--max_new_tokens", str(new), *trained.join]
    exported = _cli("generate", str(trained.out), "--model_name", trained.name, *args)
    assert exported.stdout == expected
    live = _cli("generate", str(llama_dir), "--checkpoint", str(trained.workdir / "ckpt" / "exp"), *args)
    assert live.stdout == expected
    assert "Running the embedding and head of run 'exp' at step 3" in live.stderr  # logs: stderr only
