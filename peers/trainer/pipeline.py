"""Choosing a training run's stages, and waiting for them when a span has no usable peer (e.g. it restarts).

``stage_groups`` takes the peers whose whole spans tile the model (``swarm.stages``), leaving out banned ones.
When the online peers do not tile it, it waits up to ``grace`` seconds, saying every few seconds what is missing
(a lone stage's peer that restarts takes ~10 s to serve again), and then raises ``NoPipelineError``. A banned peer
without which there is no pipeline is asked for a stream about once a second: a peer that restarted under the
same peer id answers, and its ban (from its previous life) is lifted at once instead of when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from privacy.peer_ids import short_id
from swarm.records import PeerRecord
from swarm.routing import PrivateSwarmError, describe
from swarm.stages import NoPipelineError, choose_stage_groups

logger = logging.getLogger(__name__)


class Trainer(Protocol):
    """What this needs of ``peers.trainer.swarm_trainer.SwarmTrainer`` (a ``SwarmClient`` and the run's name)."""

    client: Any
    run_id: str

POLL = 0.5  # seconds between snapshots while waiting
NOTICE_EVERY = 5.0  # seconds between "waiting for ..." messages
PROBE_EVERY, PROBE_TIMEOUT = 1.0, 3.0  # seconds: how often a banned peer that blocks the pipeline is tried again


async def stage_groups(trainer: Trainer, grace: float, since: float | None = None) -> list[list[PeerRecord]]:
    """The stages to use now, without banned peers; a snapshot that lacks some (a peer restarts, a heartbeat is
    late) is retried until ``grace`` seconds after ``since`` (``time.monotonic()``, default now: when the run lost
    a stage, so that retries share one wait) before ``NoPipelineError`` is raised. If only banned peers are missing,
    their bans are waited for up to the router's ``max_wait`` (or lifted when they answer again), then the error
    names them; sealed records (a private swarm we are no member of) raise ``PrivateSwarmError``."""
    client = trainer.client
    router, num_blocks = client.router, client.model_config.num_layers
    began = time.monotonic() if since is None else since
    so_far = time.monotonic() - began  # a retry after a failure goes on with the same wait (and its notices)
    noticed, probed = (so_far // NOTICE_EVERY * NOTICE_EVERY if so_far >= 1.0 else -NOTICE_EVERY), 0.0
    while True:
        snapshot, banned = router.without_moved(await client._fetch()), router.banned()  # no stale moved records
        try:
            return choose_stage_groups([r for r in snapshot if r.peer_id not in banned], num_blocks)
        except NoPipelineError as e:
            waited = time.monotonic() - began
            if banned and waited - probed >= PROBE_EVERY:
                probed = waited
                if await _take_back(trainer, snapshot, banned):
                    continue
            if waited >= grace:
                why_no_pipeline(trainer, e, snapshot, banned, waited)
            if waited - noticed >= NOTICE_EVERY:
                noticed = waited // NOTICE_EVERY * NOTICE_EVERY
                logger.info("Run %s: waiting for the stages' peers (%s) for %.0f s so far, up to %.0f s",
                            trainer.run_id, str(e).split(";")[0], waited, grace)
        await asyncio.sleep(POLL)


async def _take_back(trainer: Trainer, snapshot: list[PeerRecord], banned: set[str]) -> bool:
    """Lift the ban of each banned peer of the pipeline we would have with them that accepts a stream now (a peer
    that restarted with its identity); True if any did."""
    client = trainer.client
    try:
        groups = choose_stage_groups(snapshot, client.model_config.num_layers)
    except NoPipelineError:
        return False
    back = False
    for peer_id in {r.peer_id for group in groups for r in group} & banned:
        try:
            await asyncio.wait_for(client.peer_stream(peer_id), PROBE_TIMEOUT)
        except Exception as e:  # still gone (or refusing): its ban stands
            logger.debug("Banned peer %s does not answer yet: %r", short_id(peer_id), e)
            continue
        logger.info("Run %s: banned peer %s answers again (restarted?): its ban is lifted", trainer.run_id,
                    short_id(peer_id))
        client.router.on_success(peer_id)
        back = True
    return back


def why_no_pipeline(trainer: Trainer, error: NoPipelineError, snapshot: list[PeerRecord], banned: set[str],
                    waited: float) -> None:
    """Raise what stands in the way of a pipeline, unless it is bans that end within the router's wait."""
    client = trainer.client
    router = client.router
    if not snapshot and getattr(snapshot, "sealed", 0):
        raise PrivateSwarmError(client.model_name, snapshot.sealed) from error
    try:
        choose_stage_groups(snapshot, client.model_config.num_layers)  # with the banned peers
    except NoPipelineError:
        raise error from None
    left_out = router.unavailable(r.peer_id for r in snapshot if r.peer_id in banned)
    if left_out and waited + min(u.seconds_left for u in left_out) <= router.max_wait:
        return  # their bans end soon: wait for them
    raise NoPipelineError(f"{error}; with the peers banned after failures it would: {describe(left_out)}; they "
                          f"are tried again when their bans end (check them with `swarm status`)") from None
