"""LoRA adapters on a public swarm's peers (issue 19) on real processes: peers started with no ``--trainers`` refuse
base training but train a run's own adapters (the default ``--adapters anyone``); a LoRA run through 3 peers gives
the losses of the same LoRA run in one process, bit for bit in fp32, while another client's greedy generation stays
identical before, during and after it; the adapters belong to the run's trainer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsFetch

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, schedule="constant", clip_norm=1.0, weight_decay=0.01)
ADAPTER = "lora:r=4,alpha=8,targets=q_proj+v_proj+down_proj"
SEED = 11
TEXT = "Adapters belong to the run; the shared weights stay as they are for everyone else. " * 40
STEPS, ACCUMULATION = 4, 2
STAGES = {"a": "0:3", "b": "3:6", "c": "6:8"}
PROMPT = torch.tensor([[72, 101, 108, 108, 111, 32]])


@pytest.fixture(scope="module")
def adapter_swarm(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, dict[str, SwarmProcess]]]:
    """Three peers with no --trainers (a public swarm's default) and --checkpoint_dir."""
    workdir = tmp_path_factory.mktemp("adapter_swarm")
    with LocalSwarm(workdir, update_period=1.0) as swarm:
        swarm.start_dht()
        procs = {name: swarm.start_peer(llama_dir, block_indices=span, wait=False, name=name,
                                        extra=["--checkpoint_dir", str(workdir / f"ckpt-{name}")])
                 for name, span in STAGES.items()}
        for proc in procs.values():
            swarm.wait_ready(proc)
        yield swarm, procs


def _client(swarm: LocalSwarm, llama_dir, name: str = "trainer") -> SwarmClient:
    client = SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(name), request_timeout=30))
    client.wait_for_records(3)
    return client


@pytest.fixture(scope="module")
def lora_run(adapter_swarm, llama_dir) -> Iterator[SimpleNamespace]:
    """A LoRA run of ``STEPS`` steps through the three peers next to the same run in one process, while another
    client generates greedily over and over; the trainer's client stays open for the module's tests."""
    swarm, procs = adapter_swarm
    with _client(swarm, llama_dir) as client, _client(swarm, llama_dir, "other") as other:
        base = SwarmTrainer(client, OPTIM, ACCUMULATION, run_id="base-run")
        with pytest.raises(RequestError, match="does not train"):  # no --trainers: the blocks never train
            base.start()
        greedy = other.generate(PROMPT, 12)
        reference = LocalTrainer(llama_dir, OPTIM, ACCUMULATION, stages=[(0, 3), (3, 6), (6, 8)], adapter=ADAPTER,
                                 seed=SEED)
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=2, run_id="lora-run", adapter=ADAPTER,
                               adapter_seed=SEED, checkpoint_every=STEPS)
        trainer.start()
        during: list[torch.Tensor] = []
        stop = threading.Event()

        def generate_meanwhile() -> None:
            while not stop.is_set():
                during.append(other.generate(PROMPT, 12))

        generating = threading.Thread(target=generate_meanwhile)
        generating.start()
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=1)
        swarm_losses, local_losses = [], []
        try:
            for _ in range(STEPS):
                micro = [data.next_micro() for _ in range(ACCUMULATION)]
                swarm_losses.append(trainer.train_step(micro).loss)
                local_losses.append(reference.train_step(micro))
        finally:
            stop.set()
            generating.join()
        yield SimpleNamespace(swarm=swarm, procs=procs, client=client, other=other, greedy=greedy, during=during,
                              after=other.generate(PROMPT, 12), reference=reference, swarm_losses=swarm_losses,
                              local_losses=local_losses)


def _greedy(reference: LocalTrainer, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, reference.logits(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


def test_lora_run_equals_one_process_and_leaves_others_unchanged(lora_run):
    run = lora_run
    assert run.swarm_losses == run.local_losses  # bit-equal in fp32
    assert run.swarm_losses[-1] < run.swarm_losses[0]
    assert run.during and all(torch.equal(g, run.greedy) for g in run.during)  # during the run
    assert torch.equal(run.after, run.greedy)  # and after it
    # the adapters are the run's trainer's: another peer id can neither fetch nor generate with them
    stage = run.procs["b"]
    mine = run.client.loop.run(run.client.peer_stream(stage.peer_id))
    _, flat = run.client.loop.run(mine.call(ParamsFetch(start=3, end=6, run_id="lora-run"), None, 10))
    want = torch.cat([p.detach().reshape(-1) for p in run.reference.adapters[1].params()])
    assert torch.equal(flat, want)
    theirs = run.other.loop.run(run.other.peer_stream(stage.peer_id))
    with pytest.raises(RequestError, match="another trainer's adapters"):
        run.other.loop.run(theirs.call(ParamsFetch(start=3, end=6, run_id="lora-run"), None, 10))
    with pytest.raises(RequestError, match="no adapter 'lora-run' of yours"):
        run.other.loop.run(theirs.forward(3, 6, torch.zeros(1, 4, 64), 10, adapter="lora-run"))


def test_generation_with_the_runs_adapter_equals_one_process(lora_run, llama_dir):
    """The run's trainer names its run: the peers apply its adapters to that client's session only."""
    run = lora_run
    config = ClientConfig(swarm=run.swarm.trainer_config(), request_timeout=30, adapter="lora-run")
    with SwarmClient(llama_dir, config=config) as adapted:
        adapted.wait_for_records(3)
        ids = PROMPT.repeat(2, 1)
        torch.testing.assert_close(adapted.forward(ids), run.reference.logits(ids).detach(), rtol=0, atol=1e-5)
        generated = adapted.generate(PROMPT, 12)
        assert torch.equal(generated, _greedy(run.reference, PROMPT, 12))
        assert not torch.equal(generated, run.greedy)  # the adapter changes what is generated
    assert torch.equal(run.other.generate(PROMPT, 12), run.greedy)


def test_export_loads_in_peft_and_runs_on_the_swarm(lora_run, llama_dir, tmp_path, swarm_cli):
    """``swarm export`` writes the run's adapters in peft format (live and from the peers' checkpoints alike);
    transformers + peft give the swarm's logits, and another client generates with the folder on the swarm."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    run = lora_run
    config = tmp_path / "lora-run.toml"
    config.write_text(f'model_dir = "{llama_dir}"\nadapter = "{ADAPTER}"\nseed = {SEED}\n')
    live = swarm_cli("export", str(config), "--out", str(tmp_path / "live"), "--initial_peers",
                     *run.swarm.initial_peers, "--identity_path", str(run.swarm.trainer_identity("trainer")))
    assert live.returncode == 0, live.stderr[-2000:]
    saved = swarm_cli("export", str(config), "--out", str(tmp_path / "saved"), "--blocks_from",
                      *[str(run.swarm.workdir / f"ckpt-{name}") for name in STAGES])
    assert saved.returncode == 0, saved.stderr[-2000:]
    files = [(tmp_path / name / "adapter_model.safetensors").read_bytes() for name in ("live", "saved")]
    assert files[0] == files[1]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir), tmp_path / "live")
    ids = PROMPT.repeat(2, 1)
    with torch.no_grad():
        theirs = model.eval()(ids).logits
    swarm_config = ClientConfig(swarm=run.swarm.trainer_config("other"), request_timeout=30,
                                adapter=str(tmp_path / "live"))
    with SwarmClient(llama_dir, config=swarm_config) as client:
        client.wait_for_records(3)
        ours = client.forward(ids)
        assert torch.equal(client.generate(PROMPT, 12), _greedy(run.reference, PROMPT, 12))
    assert (theirs - ours).abs().max() <= 1e-5


def test_swarm_train_cli_trains_an_adapter(lora_run, llama_dir, tmp_path, swarm_cli):
    """``swarm train`` with ``adapter`` in its config: the held-out loss (through the run's adapters) falls, and the
    shared weights serve every other client as before."""
    run = lora_run
    config = tmp_path / "cli-lora.toml"
    config.write_text(f'model_dir = "{llama_dir}"\ndata = "text.txt"\nadapter = "lora:r=2,targets=q_proj+v_proj"\n'
                      'seq_len = 16\nbatch_size = 4\nmicro_batch = 2\nsteps = 3\n[optim]\nlr = 1e-2\n')
    (tmp_path / "text.txt").write_text(TEXT)
    result = swarm_cli("train", str(config), "--initial_peers", *run.swarm.initial_peers, "--identity_path",
                       str(run.swarm.trainer_identity("cli")), "--eval_windows", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.rsplit("summary ", 1)[1].splitlines()[0])
    assert summary["steps_done"] == 3 and summary["held_out_after"] < summary["held_out_before"]
    assert torch.equal(run.other.generate(PROMPT, 12), run.greedy)


def test_a_prompt_run_trains_on_peers_with_no_trainers(lora_run, llama_dir):
    """Prompt tuning changes nothing a peer serves either: ``--adapters`` (default anyone) allows it, not
    ``--trainers``; its losses equal one process and everyone else's generation is unchanged."""
    run = lora_run
    reference = LocalTrainer(llama_dir, OPTIM, 1, stages=[(0, 3), (3, 6), (6, 8)], prompts=4, deep_prompts=True,
                             seed=SEED)
    with _client(run.swarm, llama_dir, "prompter") as client:
        trainer = SwarmTrainer(client, OPTIM, 1, in_flight=1, topology="star", run_id="prompt-run", prompts=4,
                               deep_prompts=True, prompt_seed=SEED)
        trainer.start()
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=3)
        for _ in range(2):
            micro = [data.next_micro()]
            assert trainer.train_step(micro).loss == reference.train_step(micro)
    assert torch.equal(run.other.generate(PROMPT, 12), run.greedy)
