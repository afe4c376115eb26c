"""Every secret file the owner's commands write is mode 0600 from creation on, whatever the umask; existing ones
that others may read are made 0600, with a warning (issue 15, finding 9)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from privacy.files import append_private, secure_existing, write_private


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def swarm(swarm_cli):
    """``swarm ARGS`` run in this process under a umask (no network: keygen, identity, invite, revoke without
    --initial_peers), which must succeed."""
    def run(*args: str, umask: int = 0o022) -> SimpleNamespace:
        done = swarm_cli(*args, umask=umask)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    return run


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_finding_09_owner_commands_write_only_0600_files(swarm, tmp_path, umask):
    owner_key, member_id, credentials = tmp_path / "owner.key", tmp_path / "alice.id", tmp_path / "alice.member"
    swarm("keygen", "--owner_key", str(owner_key), umask=umask)
    swarm("identity", "--identity_path", str(member_id), umask=umask)
    swarm("invite", "--owner_key", str(owner_key), "--member_key", str(member_id), "--name", "alice",
          "--out", str(credentials), umask=umask)
    swarm("revoke", "--owner_key", str(owner_key), "--name", "alice", umask=umask)
    ledger, revocation = Path(f"{owner_key}.members.jsonl"), Path(f"{owner_key}.revocation")
    assert "alice" in ledger.read_text()
    for path in (owner_key, member_id, credentials, ledger, revocation):
        assert mode(path) == 0o600, f"{path.name} is {mode(path):04o}"
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


def test_finding_09_readable_ledger_and_revocation_are_made_0600_with_a_warning(swarm, tmp_path):
    owner_key, member_id = tmp_path / "owner.key", tmp_path / "bob.id"
    ledger, revocation = Path(f"{owner_key}.members.jsonl"), Path(f"{owner_key}.revocation")
    swarm("keygen", "--owner_key", str(owner_key))
    swarm("identity", "--identity_path", str(member_id))
    invite = ("invite", "--owner_key", str(owner_key), "--member_key", str(member_id), "--out")
    swarm(*invite, str(tmp_path / "bob1.member"), "--name", "bob")
    ledger.chmod(0o644)  # as the old code left it
    again = swarm(*invite, str(tmp_path / "bob2.member"), "--name", "bob")
    assert mode(ledger) == 0o600
    assert f"member ledger file {ledger} had mode 0644" in again.stderr and "it is now 0600" in again.stderr
    assert len(ledger.read_text().splitlines()) == 2  # appended, nothing lost

    swarm("revoke", "--owner_key", str(owner_key), "--serial", "0" * 32)
    revocation.chmod(0o644)
    ledger.chmod(0o640)
    revoked = swarm("revoke", "--owner_key", str(owner_key), "--name", "bob")
    assert mode(revocation) == 0o600 and mode(ledger) == 0o600
    assert f"revocation file {revocation} had mode 0644" in revoked.stderr
    assert f"member ledger file {ledger} had mode 0640" in revoked.stderr
    assert "3 certificate(s)" in revoked.stdout  # the earlier revocation is kept


def test_finding_09_append_private_creates_0600_and_tightens(tmp_path, caplog):
    old = os.umask(0)
    try:
        path = append_private(tmp_path / "new" / "ledger", b"one\n", what="test ledger")
        assert mode(path) == 0o600 and mode(path.parent) == 0o700
        path.chmod(0o666)
        append_private(path, b"two\n", what="test ledger")
        assert mode(path) == 0o600 and path.read_bytes() == b"one\ntwo\n"
        assert "test ledger file" in caplog.text and "had mode 0666" in caplog.text
        caplog.clear()
        written = write_private(tmp_path / "secret", b"x", what="test secret")
        assert mode(written) == 0o600
        secure_existing(written, what="test secret")  # already private: nothing to say
        assert caplog.text == ""
    finally:
        os.umask(old)
