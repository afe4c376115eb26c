"""What a graph peer serves (``GraphServing``): one ``GraphStage`` of a traced operator graph, its inference forwards
and the training run open on it (two-phase steps: forwards keep what their backward needs, backwards accumulate, an
apply commits the step with AdamW). Computation runs on a thread, one at a time, in the order requests arrive.

A refusal changes nothing: a forward or backward refused before it ran leaves no trace; an apply holding another
number of micro-batches than the trainer sent drops the step's gradients (nothing applied).

With a ``checkpoint_dir`` the stage saves its run every ``checkpoint_every`` steps (the trainer's ``GraphOpen``
says how often; weights, AdamW state, BatchNorm statistics and the step, in
``checkpoint_dir/<run_id>/graph-<hash 12>-<start>-<end>``), and a run opened here anew (e.g. after a restart) resumes
from that checkpoint: its weights, optimizer and step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peers.core.trainers import TrainerPolicy
from peers.model.graph.autodiff import Saved, train_backward, train_forward
from peers.model.graph.registry import ARCHITECTURES
from peers.model.graph.stage import GraphStage
from peers.model.graph.trace import EdgeSpec
from peers.server.averaging import ReplicaAverager, round_at
from peers.server.graph_replicas import StreamFor, check_replicas, copy_from, flat_state, load_flat, numel
from peers.training.state import STATE_FILE, load_stage_state, run_checkpoint_dir, save_stage_state
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsPush

logger = logging.getLogger(__name__)

MAX_KEPT = 64  # micro-batches a run may keep between their forward and backward
OPTIM_KEYS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def adamw_settings(optim: Mapping[str, Any]) -> dict[str, Any]:
    """AdamW's settings from a ``GraphOpen.optim`` map; ``RequestError`` for an unknown key or a value out of bounds."""
    unknown = sorted(set(optim) - set(OPTIM_KEYS))
    if unknown:
        raise RequestError(f"unknown optimizer settings {unknown}; a graph run takes {sorted(OPTIM_KEYS)}")
    cfg = {**OPTIM_KEYS, **optim}
    try:
        lr, eps, wd = float(cfg["lr"]), float(cfg["eps"]), float(cfg["weight_decay"])
        b1, b2 = (float(b) for b in cfg["betas"])
    except (TypeError, ValueError):
        raise RequestError(f"optimizer settings must be numbers (betas two of them), got {optim}") from None
    if not (0 < lr <= 1 and 0 <= b1 < 1 and 0 <= b2 < 1 and 0 < eps < 1 and 0 <= wd <= 1):
        raise RequestError(f"optimizer settings out of bounds: lr in (0, 1], betas in [0, 1), eps in (0, 1), "
                           f"weight_decay in [0, 1]; got {optim}")
    return {"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": wd}


@dataclass(eq=False)
class GraphRun:
    """A training run on the stage: its trainer, optimizer and the micro-batches of the step under way."""

    run_id: str
    trainer: str
    optimizer: torch.optim.Optimizer | None  # None: a stage without parameters (a pooling, a reshape)
    kept: dict[str, Saved] = field(default_factory=dict)  # forwarded, not yet backwarded
    accumulated: int = 0  # backwards since the last step
    shared: tuple[str, ...] = ()  # parameters tied with another stage's: their gradient per micro-batch, kept apart
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)  # this step's, in backward order
    step: int = 0
    checkpoint_every: int = 0  # save every this many steps (0: never), with a checkpoint_dir
    averager: ReplicaAverager | None = None  # replicas of this stage in the run (``peers.server.graph_replicas``)
    average_every: int = 1


class GraphServing:
    """One stage of graph ``graph_hash`` (``arch``), nodes ``[stage.start, stage.end)``."""

    def __init__(self, stage: GraphStage, graph_hash: str, trainers: TrainerPolicy,
                 checkpoint_dir: Path | None = None, *, peer_id: str = "", stream_for: StreamFor | None = None,
                 average_timeout: float = 30.0) -> None:
        self.stage, self.graph_hash, self.trainers = stage, graph_hash, trainers
        self.checkpoint_dir = checkpoint_dir
        # replicas: our peer id, streams to the other replicas, and how long a round waits for them
        self.peer_id, self.stream_for, self.average_timeout = peer_id, stream_for, average_timeout
        self.arch, self.start, self.end = stage.arch, stage.start, stage.end
        self.run: GraphRun | None = None
        self._lock = asyncio.Lock()  # one computation at a time, in arrival order
        self.grad_inputs = tuple(s for s in stage.inputs if s.dtype.is_floating_point)
        self.grad_outputs = tuple(s for s in stage.outputs if s.dtype.is_floating_point)
        # the first optimizer of a process imports much of torch (seconds): here, not on the event loop at an open,
        # where it would starve the stream's heartbeats
        warm = torch.zeros(1, requires_grad=True)
        warm.grad = torch.zeros(1)
        torch.optim.AdamW([warm]).step()

    # ---- checks -----------------------------------------------------------------------------------
    def check_graph(self, arch: str, graph_hash: str, start: int | None = None, end: int | None = None) -> None:
        """``RequestError`` unless the request names what this peer serves."""
        if arch not in ARCHITECTURES:
            raise RequestError(f"unknown architecture {arch[:64]!r}: peers only trace architectures they have "
                               f"locally; known: {', '.join(sorted(ARCHITECTURES))}")
        if arch != self.arch:
            raise RequestError(f"this peer serves a graph of {self.arch}, not {arch}")
        self.check_hash(graph_hash)
        if start is not None and (start, end) != (self.start, self.end):
            raise RequestError(f"this peer serves nodes {self.start}:{self.end} of {self.arch}, not {start}:{end}; "
                               f"refresh your view of the swarm")

    def check_hash(self, graph_hash: str) -> None:
        if graph_hash != self.graph_hash:
            raise RequestError(f"graph hash mismatch: the request names {graph_hash[:16]!r}, this peer traced "
                               f"{self.graph_hash[:16]}; trace the same architecture, config and input shape (and "
                               f"the same torch and transformers versions)")

    def check_trainer(self, caller: str) -> None:
        if not self.trainers.allows(caller):
            raise RequestError(f"not allowed to train here: this peer trains for {self.trainers.describe()} "
                               f"(its operator's --trainers)")

    def run_of(self, run_id: str, caller: str) -> GraphRun:
        self.check_trainer(caller)
        run = self.run
        if run is None or run.run_id != run_id or run.trainer != caller:
            raise RequestError(f"no graph run {run_id[:64]!r} of yours is open here: send graph_open first")
        return run

    # ---- requests ---------------------------------------------------------------------------------
    async def open(self, run_id: str, optim: Mapping[str, Any], caller: str, shared: Sequence[str] = (),
                   checkpoint_every: int = 0, replicas: Sequence[str] = (), average_every: int = 1,
                   source: str = "") -> int:
        """Open (or re-open: its optimizer and step are kept) ``run_id``; another run open here is closed. A run
        new here resumes from this stage's checkpoint of it, if there is one, else copies the weights of replica
        ``source`` if named. ``replicas``: the run's other peers serving these nodes, averaged with every
        ``average_every`` steps."""
        self.check_trainer(caller)
        settings = adamw_settings(optim)
        self.shared_specs(list(shared))  # parameters of this stage
        if not 0 < len(run_id) <= 128:
            raise RequestError("a run id is 1 to 128 characters")
        if not 0 <= checkpoint_every <= 1 << 20:
            raise RequestError(f"checkpoint_every must be in 0..{1 << 20}, got {checkpoint_every}")
        replicas = sorted(set(replicas) - {self.peer_id})
        check_replicas(replicas, self.peer_id, source, average_every)
        if replicas and shared:
            raise RequestError("a stage holding parameters tied to another stage's cannot have replicas yet")
        if replicas and self.stream_for is None:
            raise RequestError("this peer cannot reach other replicas")
        run = self.run
        if run is not None and run.run_id == run_id and run.trainer == caller:
            run.checkpoint_every = checkpoint_every
            run.shared = tuple(shared)
            run.parts.clear()
            run.kept.clear()
            run.accumulated = 0
            self.stage.zero_grad(set_to_none=True)
            self._replicate(run, replicas, average_every)
            return run.step
        if run is not None:
            logger.info("Graph run %r closed: run %r opens", run.run_id, run_id)
        self.stage.zero_grad(set_to_none=True)
        params = list(self.stage.parameters())
        optimizer = torch.optim.AdamW(params, **settings) if params else None
        step = self._resume(run_id, optimizer)
        if not step and source:
            assert self.stream_for is not None
            async with self._lock:
                step = await copy_from(source, self.stream_for, self.stage.module, self.graph_hash,
                                       self.average_timeout)
            logger.info("Graph run %r: copied the weights of replica %s (at step %d)", run_id, source[-8:], step)
        self.run = GraphRun(run_id, caller, optimizer, shared=tuple(shared), step=step,
                            checkpoint_every=checkpoint_every)
        self._replicate(self.run, replicas, average_every)
        logger.info("Graph run %r of %s opened on nodes %d:%d at step %d%s", run_id, caller[-8:], self.start,
                    self.end, step, f" with {len(replicas)} other replica(s)" if replicas else "")
        return step

    def _replicate(self, run: GraphRun, replicas: list[str], average_every: int) -> None:
        """Averaging with ``replicas`` (a new averager if the replicas or the period changed; none without)."""
        current = run.averager
        if not replicas:
            run.averager = None
        elif current is None or current.replicas != replicas or run.average_every != average_every:
            assert self.stream_for is not None
            run.averager = ReplicaAverager(self.peer_id, run.run_id, replicas, self.stream_for,
                                           timeout=self.average_timeout, first_round=round_at(run.step, average_every))
        run.average_every = average_every

    def receive_params(self, request: ParamsPush, flat: torch.Tensor, caller: str) -> None:
        """A replica's parameters for an averaging round of the run open here."""
        run = self.run
        if run is None or run.run_id != request.run_id or run.averager is None:
            raise RequestError(f"no graph run {request.run_id[:64]!r} with replicas is open here")
        if request.anchor:
            raise RequestError("graph replicas average their parameters in full (no anchor)")
        run.averager.receive(caller, request.round, flat, numel(self.stage.module))

    def checkpoint_path(self, run_id: str) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        return run_checkpoint_dir(self.checkpoint_dir, run_id) / f"graph-{self.graph_hash[:12]}-{self.start}-{self.end}"

    def _meta(self, run_id: str) -> dict[str, Any]:
        return {"kind": "graph", "run_id": run_id, "arch": self.arch, "graph_hash": self.graph_hash,
                "nodes": [self.start, self.end]}

    def _resume(self, run_id: str, optimizer: torch.optim.Optimizer | None) -> int:
        """Load this stage's checkpoint of ``run_id`` if it has one; its step (0: none)."""
        path = self.checkpoint_path(run_id)
        if path is None or not (path / STATE_FILE).is_file():
            return 0
        try:
            info = load_stage_state(path, self.stage.module, optimizer, expect=self._meta(run_id), buffers=True)
        except ValueError as e:
            raise RequestError(f"cannot resume run {run_id[:64]!r} from this peer's checkpoint: {e}") from None
        logger.info("Graph run %r resumed from %s at step %d", run_id, path, info["step"])
        return int(info["step"])

    async def forward(self, inputs: dict[str, torch.Tensor], run_id: str, micro_id: str, caller: str
                      ) -> dict[str, torch.Tensor]:
        if not run_id:
            async with self._lock:
                return await asyncio.to_thread(self._infer, inputs)
        run = self.run_of(run_id, caller)
        if micro_id in run.kept:
            raise RequestError(f"micro-batch {micro_id[:64]!r} was already forwarded in this step")
        if len(run.kept) >= MAX_KEPT:
            raise RequestError(f"this peer keeps at most {MAX_KEPT} micro-batches between forward and backward")
        async with self._lock:
            outputs, saved = await asyncio.to_thread(self._train_forward, inputs)
        run.kept[micro_id] = saved
        return outputs

    async def backward(self, grads: dict[str, torch.Tensor], run_id: str, micro_id: str, caller: str
                       ) -> dict[str, torch.Tensor]:
        run = self.run_of(run_id, caller)
        saved = run.kept.pop(micro_id, None)
        if saved is None:
            raise RequestError(f"no forward of micro-batch {micro_id[:64]!r} is kept here")
        grads = {k: v for k, v in grads.items() if saved.outputs[k].requires_grad}  # (a mask made of constants)
        params = dict(self.stage.module.named_parameters())
        async with self._lock:
            for name in run.shared:  # this micro-batch's part alone
                params[name].grad = None
            out = await asyncio.to_thread(train_backward, self.stage, saved, grads)
            run.parts.append({n: params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])
                              for n in run.shared})
            for name in run.shared:
                params[name].grad = None
        run.accumulated += 1
        # every floating-point input gets one (zeros where it reached nothing differentiable): the bundle is complete
        return {s.name: out[s.name] if s.name in out else torch.zeros(s.shape, dtype=s.dtype)
                for s in self.grad_inputs}

    def shared_grads(self, run_id: str, caller: str) -> tuple[dict[str, torch.Tensor], tuple[EdgeSpec, ...]]:
        """This step's gradients of the run's shared parameters, per micro-batch (``NAME#I``), and their specs."""
        run = self.run_of(run_id, caller)
        specs = self.shared_specs(list(run.shared))
        tensors = {f"{n}#{i}": part[n] for i, part in enumerate(run.parts) for n in run.shared}
        return tensors, tuple(EdgeSpec(f"{s.name}#{i}", s.shape, s.dtype) for i in range(len(run.parts))
                              for s in specs)

    def shared_specs(self, names: list[str]) -> tuple[EdgeSpec, ...]:
        params = dict(self.stage.module.named_parameters())
        unknown = sorted(set(names) - set(params))
        if unknown:
            raise RequestError(f"this stage holds no parameters {unknown[:5]}")
        return tuple(EdgeSpec(n, tuple(params[n].shape), params[n].dtype) for n in names)

    async def apply(self, run_id: str, micro_batches: int, caller: str,
                    shared: Mapping[str, torch.Tensor] | None = None) -> int:
        """Commit the step; ``shared``: the summed gradients of parameters tied with another stage's, which replace
        this stage's own (finite, checked before anything changes)."""
        run = self.run_of(run_id, caller)
        for name, grad in (shared or {}).items():
            if not torch.isfinite(grad).all():
                self._drop(run)
                raise RequestError(f"the shared gradient of {name!r} holds NaN or infinite values; the step was "
                                   f"dropped")
        if micro_batches != run.accumulated or run.kept:
            got, pending = run.accumulated, len(run.kept)
            self._drop(run)
            raise RequestError(f"step refused: the trainer sent {micro_batches} micro-batches, this stage holds "
                               f"{got} backwarded and {pending} not; the step's gradients were dropped")
        if micro_batches < 1:
            raise RequestError("a step needs at least one micro-batch")
        if set(shared or {}) != set(run.shared):
            self._drop(run)
            raise RequestError(f"step refused: this run shares parameters {list(run.shared)}, the apply carries "
                               f"{sorted(shared or {})}; the step's gradients were dropped")
        params = dict(self.stage.module.named_parameters())
        for name, grad in (shared or {}).items():
            params[name].grad = grad.clone()
        async with self._lock:
            await asyncio.to_thread(self._step, run)
            run.accumulated, run.step = 0, run.step + 1
            if run.averager is not None and run.step % run.average_every == 0:
                mean = await run.averager.average(flat_state(self.stage.module), round_at(run.step, run.average_every))
                load_flat(self.stage.module, mean)
            path = self.checkpoint_path(run.run_id)
            if path is not None and run.checkpoint_every and run.step % run.checkpoint_every == 0:
                await asyncio.to_thread(save_stage_state, path, self.stage.module, run.optimizer, run.step,
                                        self._meta(run.run_id), buffers=True)
        return run.step

    def drop(self, run_id: str, caller: str) -> None:
        """A refused backward: the step cannot complete; drop its micro-batches and gradients."""
        run = self.run
        if run is not None and run.run_id == run_id and run.trainer == caller:
            self._drop(run)

    def state(self) -> tuple[dict[str, torch.Tensor], tuple[EdgeSpec, ...]]:
        """The stage's parameters and buffers by key, and their specs (for a ``GraphFetch`` bundle)."""
        tensors = {k: v.detach() for k, v in self.stage.module.state_dict().items()}
        return tensors, tuple(EdgeSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items())

    # ---- on the compute thread --------------------------------------------------------------------
    def _infer(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.stage.eval()
        with torch.no_grad():
            return self.stage(inputs)

    def _train_forward(self, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Saved]:
        self.stage.train()
        return train_forward(self.stage, inputs)

    def _step(self, run: GraphRun) -> None:
        if run.optimizer is not None:
            run.optimizer.step()
        self.stage.zero_grad(set_to_none=True)
        run.parts.clear()

    def _drop(self, run: GraphRun) -> None:
        run.parts.clear()
        run.kept.clear()
        run.accumulated = 0
        self.stage.zero_grad(set_to_none=True)
