"""Who may train a peer's blocks: its operator's ``--trainers`` choice. Training is off unless they opt in.

A peer serves the weights it trains, so a trainer changes what every client of that peer computes. A peer
therefore refuses every training call unless its operator started it with one of:

- ``--trainers PEER_ID[,PEER_ID...]``: only these trainers (``swarm identity --identity_path ID`` prints a
  trainer's peer id; the trainer passes the same ``--identity_path`` to ``swarm train``);
- ``--trainers members``: any admitted member of the private swarm (the owner's invites decide who);
- ``--trainers anyone``: any peer that reaches this one (logged as a warning).

Replicas of a run (``ParamsPush``) are accepted only from the peers an allowed trainer named for the run, and
``ParamsFetch`` (a replica's current parameters) is readable by anyone admitted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from privacy.errors import PrivacyError
from privacy.peer_ids import public_key_of, short_id

ANYONE, MEMBERS = "anyone", "members"
FLAG_HELP = ("who may train this peer's blocks (which it then serves): PEER_ID[,PEER_ID...] (trainers' peer ids, "
             "from `swarm identity`), 'members' (any member of this private swarm) or 'anyone'; default: nobody")


def parse_trainers(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"id1,id2"`` (or a list of such strings) -> ``("id1", "id2")``; checks each entry (``ValueError``)."""
    if text is None:
        return ()
    parts = [text] if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(n for part in parts for n in re.split(r"[,\s]+", part) if n))
    keywords = [n for n in names if n.lower() in (ANYONE, MEMBERS)]
    if keywords and len(names) > 1:
        raise ValueError(f"--trainers {','.join(names)}: '{keywords[0].lower()}' stands alone; pass either it or "
                         "a list of peer ids")
    if keywords:
        return (keywords[0].lower(),)
    for name in names:
        try:
            public_key_of(name)
        except PrivacyError:
            raise ValueError(f"--trainers: {name!r} is not a peer id (like 12D3KooW...); a trainer prints its "
                             "own with `swarm identity --identity_path ID`, or pass 'members' or 'anyone'") from None
    return names


@dataclass(frozen=True)
class TrainerPolicy:
    """The operator's choice: ``()`` (no training), ``("anyone",)``, ``("members",)`` or trainer peer ids."""

    trainers: tuple[str, ...] = ()
    private: bool = False  # the peer is in a private swarm (only admitted members reach the training calls)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainers", parse_trainers(self.trainers))
        if self.trainers == (MEMBERS,) and not self.private:
            raise ValueError("--trainers members means the members of a private swarm, and this peer is in a public "
                             "one: pass --private CREDENTIALS too, list the trainers' peer ids, or pass 'anyone'")

    @property
    def enabled(self) -> bool:
        return bool(self.trainers)

    @property
    def anyone(self) -> bool:
        return self.trainers == (ANYONE,)

    def allows(self, caller: str) -> bool:
        """May peer ``caller`` (already admitted to the swarm) open, run and commit training steps here?"""
        if self.trainers in ((ANYONE,), (MEMBERS,)):
            return True  # in a private swarm, non-members were refused before any training call
        return caller in self.trainers

    def describe(self) -> str:
        if not self.trainers:
            return "no trainer"
        if self.anyone:
            return "anyone" + (" admitted (members of this private swarm)" if self.private else " who reaches it")
        if self.trainers == (MEMBERS,):
            return "members of this private swarm"
        return "trainer(s) " + ", ".join(f"{short_id(p)}" for p in self.trainers)

    def refusal(self, caller: str) -> str:
        """Why ``caller`` may not train here, and what the operator must pass ('' if it may)."""
        if not self.trainers:
            return (f"this peer does not train: its operator must allow trainers, e.g. restart it with --trainers "
                    f"{caller} (your peer id){' or --trainers members' if self.private else ''}")
        if self.allows(caller):
            return ""
        return (f"peer {caller} may not train this peer (it allows {self.describe()}): its operator must add your "
                f"peer id to --trainers")
