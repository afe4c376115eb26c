"""privacy: who may take part in a swarm, and what the wire reveals.

This package depends on nothing else of fusionswarm. It is wrapped around the wire by ``peers/``;
handlers never branch on privacy. Planned modules, in data-flow order (see the privacy issue):

- ``identity.py``: load or create a peer's Ed25519 identity key (file mode 0600).
- ``membership.py``: owner key, member certificates and revocations, the RPC authorizer.
- ``records.py``: a DHT record validator that signs, checks and encrypts records of a private swarm.
- ``channel.py``: X25519 session key agreement and AEAD encryption of serialized tensors.

Until those land, a swarm is public: anyone who knows a bootstrap address can join and read activations.
"""
