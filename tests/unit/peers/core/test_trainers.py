"""``--trainers``: who may train a peer. Nobody by default; peer ids, 'members' of a private swarm, or 'anyone'."""

from __future__ import annotations

import pytest

from peers.cli.commands import _parser
from peers.core.trainers import TrainerPolicy, parse_trainers
from peers.server.training_rpc import training_refusal
from privacy.identity import Identity
from privacy.peer_ids import peer_id_of

ALICE, BOB = (peer_id_of(Identity.generate().public_bytes) for _ in range(2))


def test_finding_01_training_is_off_unless_the_operator_allows_trainers():
    args = _parser().parse_args(["peer", "model", "--num_blocks", "1", "--new_swarm"])
    assert parse_trainers(args.trainers) == ()
    nobody = TrainerPolicy(())
    assert not nobody.enabled and not nobody.allows(ALICE)
    refusal = training_refusal(None, object(), ALICE)  # a peer without --trainers has no training side at all
    assert "does not train" in refusal and f"--trainers {ALICE} (your peer id)" in refusal


def test_trainer_ids_members_and_anyone():
    assert parse_trainers(f"{ALICE},{BOB}") == (ALICE, BOB) == parse_trainers([ALICE, f" {BOB}, {ALICE}"])
    only = TrainerPolicy((ALICE,))
    assert only.allows(ALICE) and not only.allows(BOB)
    assert f"peer {BOB} may not train this peer" in only.refusal(BOB) and "add your peer id to --trainers" in \
        only.refusal(BOB)
    assert TrainerPolicy("Members", private=True).allows(BOB)  # admission already refused non-members
    assert TrainerPolicy("anyone").anyone and TrainerPolicy("anyone").allows(BOB)
    with pytest.raises(ValueError, match="members of a private swarm"):
        TrainerPolicy("members")  # a public swarm has no members
    with pytest.raises(ValueError, match="stands alone"):
        parse_trainers(f"anyone,{ALICE}")
    with pytest.raises(ValueError, match="is not a peer id"):
        parse_trainers("alice")
