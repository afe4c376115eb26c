"""Every DHT key and subkey format of fusionswarm lives here."""

from __future__ import annotations

import re

_MODEL_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
KEY_PREFIX = "fusionswarm.v1"


def check_model_name(model: str) -> str:
    """Model names become DHT keys: keep them to a safe alphabet."""
    if not isinstance(model, str) or not _MODEL_RE.fullmatch(model):  # fullmatch: `$` allows a final newline
        raise ValueError(
            f"model name {model!r} must match {_MODEL_RE.pattern} (rename the folder or pass --model_name)"
        )
    return model


def peers_key(model: str) -> str:
    """The key under which every peer of ``model`` announces its record; the subkey is the peer id."""
    return f"{KEY_PREFIX}.{check_model_name(model)}.peers"


def revocations_key() -> str:
    """The key under which members of a private swarm keep its owner's newest revocation; subkey: peer id."""
    return f"{KEY_PREFIX}.revocations"


def plans_key(model: str) -> str:
    """The key under which brokers publish their signed plans for ``model``; the subkey is the broker's peer id."""
    return f"{KEY_PREFIX}.{check_model_name(model)}.plans"
