"""A node's identity and admission, from its ``SwarmConfig``: the one place that knows how they are loaded."""

from __future__ import annotations

import logging

from peers.core.config import SwarmConfig
from privacy.admission import Admission, MemberAdmission
from privacy.identity import Identity

logger = logging.getLogger(__name__)


def load_identity(swarm: SwarmConfig) -> Identity:
    """The identity in ``--identity_path`` (created, mode 0600, if missing), else a fresh one for this run."""
    return Identity.load_or_create(str(swarm.identity_path)) if swarm.identity_path else Identity.generate()


def load_admission(swarm: SwarmConfig, identity: Identity) -> Admission:
    """A private swarm's member admission with ``--private CREDENTIALS``, else the public swarm's."""
    if swarm.credentials_path is None:
        return Admission()
    admission = MemberAdmission.load(swarm.credentials_path, identity, swarm.revocation_path)
    logger.info("Joining %s", admission.describe())
    return admission
