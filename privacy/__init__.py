"""privacy: who may take part in a swarm, and what the wire reveals.

This package depends on nothing else of fusionswarm (only ``cryptography``, ``msgpack`` and, in ``records.py``,
``hivemind``). It is wrapped around the wire by ``peers/``; handlers never branch on privacy. Modules, in
data-flow order:

- ``errors.py``: ``PrivacyError`` (a ``ValueError``) and its ``MembershipError`` and ``ChannelError``.
- ``identity.py``: a peer's Ed25519 ``Identity``, loaded or created in a file of mode 0600; ``verify_signature``.
- ``peer_ids.py``: the identity as the libp2p identity: the peer id embeds the public key (``public_key_of``), and
  ``libp2p_key_file`` writes the key for the p2p daemon.
- ``certificates.py``: wire formats: ``Certificate``, ``Revocation``, ``SwarmInfo`` (public ``swarm.pub``),
  ``MemberCredentials`` (what an invite hands to a member, mode 0600).
- ``membership.py``: ``SwarmOwner`` (invite, revoke), ``MembershipVerifier`` (certificates, revocations, RPC proofs
  from ``make_proof`` bound to a context and checked against replay). Re-exports the wire formats.
- ``records.py``: ``PrivateRecordValidator``, a hivemind record validator that signs, checks and encrypts records of
  a private swarm; members store under ``member_subkey(own public key)``.
- ``admission.py``: ``Admission`` (public swarm: everyone) and ``MemberAdmission`` (private swarm): the one object
  a caller asks for a proof and a handler asks to ``admit`` and ``recheck`` a caller, so handlers never branch.
- ``channel.py``: ``ClientHandshake`` / ``accept_handshake`` (X25519 + HKDF, peer authenticated by its identity)
  giving a ``SecureChannel`` that seals and opens serialized tensors with AES-256-GCM, in order, once each.
- ``_files.py``: private: atomic 0600 writes and refusal of files others may read.

Without a swarm owner key a swarm is public: anyone who knows a bootstrap address can join and serve blocks
(tensors on the wire stay encrypted end to end either way).
"""
