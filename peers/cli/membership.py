"""``swarm keygen / identity / invite / revoke``: run a private swarm from the command line.

The owner key never leaves the owner's machine. A member runs ``swarm identity`` and sends the owner its public
key; the owner runs ``swarm invite`` and hands back the credentials file (privately: it holds the swarm's record
secret). ``swarm revoke`` signs a revocation, saves it and, with ``--initial_peers``, publishes it to the swarm,
whose members keep spreading it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from privacy.errors import MembershipError
from privacy.files import append_private, secure_existing, write_private
from privacy.identity import Identity
from privacy.membership import Revocation, SwarmOwner
from privacy.peer_ids import peer_id_of

DAY = 86400.0


def add_membership_commands(sub) -> None:
    keygen = sub.add_parser("keygen", help="create a private swarm: its owner key (keep it secret)")
    keygen.add_argument("--owner_key", type=Path, required=True, help="where to write the owner key (mode 0600)")
    keygen.set_defaults(func=_cmd_keygen)

    ident = sub.add_parser("identity", help="create or show a node identity (send its public key to the owner)")
    ident.add_argument("--identity_path", type=Path, required=True, help="identity file (created, 0600, if missing)")
    ident.set_defaults(func=_cmd_identity)

    invite = sub.add_parser("invite", help="owner: certify a member and write its credentials file")
    invite.add_argument("--owner_key", type=Path, required=True, help="the swarm's owner key (from `swarm keygen`)")
    invite.add_argument("--member_key", required=True,
                        help="the member's public key (hex, from `swarm identity`) or its identity file")
    invite.add_argument("--name", required=True, help="the member's name, shown in logs and used by revoke")
    invite.add_argument("--days", type=float, default=30.0, help="validity in days")
    invite.add_argument("--out", type=Path, required=True, help="credentials file to hand to the member (0600)")
    invite.set_defaults(func=_cmd_invite)

    revoke = sub.add_parser("revoke", help="owner: revoke members' certificates and publish the revocation")
    revoke.add_argument("--owner_key", type=Path, required=True, help="the swarm's owner key (from `swarm keygen`)")
    revoke.add_argument("--name", nargs="*", default=[], help="revoke every certificate issued under these names")
    revoke.add_argument("--serial", nargs="*", default=[], help="revoke these certificate serials")
    revoke.add_argument("--out", type=Path, default=None,
                        help="revocation file (default: next to the owner key, mode 0600); earlier revocations in it "
                             "are kept")
    revoke.add_argument("--initial_peers", nargs="+", default=[], help="publish the revocation to this swarm")
    revoke.set_defaults(func=_cmd_revoke)


def ledger_path(owner_key: Path) -> Path:
    """The owner's record of what it issued: one JSON line per certificate."""
    return Path(f"{owner_key}.members.jsonl")


def default_revocation_path(owner_key: Path) -> Path:
    return Path(f"{owner_key}.revocation")


def _cmd_keygen(args: argparse.Namespace) -> int:
    owner = SwarmOwner.generate()
    owner.save(args.owner_key)
    print(f"Created private swarm {owner.swarm_id}\nOwner key: {args.owner_key} (keep it secret and backed up)\n"
          f"Next: each member runs `swarm identity --identity_path ID` and you run `swarm invite`.")
    return 0


def _cmd_identity(args: argparse.Namespace) -> int:
    identity = Identity.load_or_create(args.identity_path)
    print(f"public key: {identity.public_bytes.hex()}\npeer id:    {peer_id_of(identity.public_bytes)}")
    return 0


def _member_key(text: str) -> bytes:
    path = Path(text).expanduser()
    if path.is_file():
        return Identity.load(path).public_bytes
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise MembershipError(f"--member_key {text!r} is neither an identity file nor a 64-digit hex public key; "
                              f"the member prints it with `swarm identity --identity_path ID`")
    return key


def _cmd_invite(args: argparse.Namespace) -> int:
    owner = SwarmOwner.load(args.owner_key)
    if args.days <= 0:
        raise ValueError("--days must be positive")
    credentials = owner.invite(_member_key(args.member_key), args.name, ttl=args.days * DAY)
    credentials.save(args.out)
    cert = credentials.certificate
    entry = {"name": cert.name, "serial": cert.serial, "key": cert.member_key.hex(), "expires_at": cert.expires_at}
    append_private(ledger_path(args.owner_key), (json.dumps(entry) + "\n").encode(), what="member ledger")
    print(f"Invited {cert.name!r} (serial {cert.serial}) until "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(cert.expires_at))}.\n"
          f"Hand {args.out} to the member privately; it joins with --private {args.out} --identity_path ITS_ID")
    return 0


def serials_for(owner_key: Path, names: list[str]) -> list[str]:
    """Every serial the owner issued under ``names`` (from its ledger)."""
    path, wanted, found = ledger_path(owner_key), set(names), []
    if path.exists():
        secure_existing(path, what="member ledger")
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    for entry in entries:
        if entry.get("name") in wanted:
            found.append(entry["serial"])
    missing = wanted - {e.get("name") for e in entries}
    if missing:
        raise MembershipError(f"no certificate was issued to {sorted(missing)} (see {path}); pass --serial instead")
    return found


def _cmd_revoke(args: argparse.Namespace) -> int:
    owner = SwarmOwner.load(args.owner_key)
    serials = [*args.serial, *serials_for(args.owner_key, args.name)]
    if not serials:
        raise ValueError("pass --name or --serial: which certificates to revoke")
    out = args.out or default_revocation_path(args.owner_key)
    previous = None
    if out.exists():
        secure_existing(out, what="revocation")
        previous = Revocation.from_bytes(out.read_bytes())
    revocation = owner.revoke(serials, previous)
    write_private(out, revocation.to_bytes(), what="revocation", overwrite=True)  # 0600, complete or not at all
    print(f"Revocation of {len(revocation.serials)} certificate(s) saved to {out}")
    if args.initial_peers:
        asyncio.run(publish(owner, revocation, args.initial_peers))
        print("Published to the swarm; members apply it within one announce period and keep spreading it.")
    else:
        print("Not published: pass --initial_peers to publish it, or give the file to peers (--revocations).")
    return 0


async def publish(owner: SwarmOwner, revocation: Revocation, initial_peers: list[str]) -> None:
    """Join the swarm as a short-lived member (the owner certifies itself) and store the revocation."""
    from privacy.admission import MemberAdmission
    from privacy.membership import MembershipVerifier
    from swarm.discovery import start_node
    from swarm.revocations import publish_revocation

    credentials = owner.invite(owner.identity.public_bytes, "owner", ttl=600)
    admission = MemberAdmission(credentials, owner.identity, MembershipVerifier(credentials.swarm))
    node = await start_node(initial_peers=initial_peers, identity=owner.identity, client_mode=True,
                            record_validator=admission.record_validator())
    try:
        if not await asyncio.wait_for(publish_revocation(node, revocation, ttl=300), 30):
            raise RuntimeError("no DHT peer stored the revocation; check --initial_peers and retry")
    finally:
        await node.shutdown()
