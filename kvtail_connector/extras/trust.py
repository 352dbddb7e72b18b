"""What binds a ``kvtail`` entry to its transfer, and the optional shared key.

An entry (:mod:`kvtail_connector.extras.entry`) travels in ``kv_transfer_params``,
which any client of D's OpenAI server can set and which routers copy whole
from P's answer. Two things tie it to what it speaks about:

- the binding (:func:`binding`): a hash of what identifies the transfer in
  the same params, as P's inner connector returned them (NIXL: engine id,
  request id, P's block ids; MoRIIO: engine id, ``transfer_id``, P's block
  ids). D recomputes it from the params the entry came with; an entry copied
  to another request's params, or kept after a router rebuilt them, does not
  match. Without a key anyone who can set D's params can compute a matching
  binding: it stops accidents, not attackers.
- the MAC (:func:`sign`): HMAC-SHA256 with a key both sides read from the
  environment variable ``entry_key_env`` names (:func:`key_from_env`). With a
  key, D trusts and uses only entries whose MAC verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from kvtail_connector.extras import entry, entry_values

# The keys of kv_transfer_params that identify a transfer, in both releases'
# NIXL (pull and push) and MoRIIO request_finished. Absent ones are left out.
BINDING_KEYS = ("remote_engine_id", "remote_request_id", "transfer_id", "remote_block_ids")
# At least one of these must be there: a binding of block ids alone names no transfer.
_IDENTITY_KEYS = ("remote_request_id", "transfer_id")

KEY_ENV_FIELD = "kv_connector_extra_config.entry_key_env"


def binding(params: Mapping[str, Any], max_nodes: int) -> str | None:
    """32 hex digits over the transfer's identity in ``params``; None where
    there is none (no request or transfer id) or it is not plain JSON of at
    most ``max_nodes`` values (bounded like the entry: D's params come from
    the network)."""
    picked = {k: params[k] for k in BINDING_KEYS if k in params}
    if not any(picked.get(k) is not None for k in _IDENTITY_KEYS):
        return None
    if entry.measure(picked, max_nodes) is None:
        return None
    try:
        text = json.dumps(picked, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:32]


def binding_nodes(limits: entry_values.Limits, min_block_size: int) -> int:
    """Values a clean binding can hold on this consumer: ids, and a block id
    per block of the longest prompt in each group (and slack)."""
    per_group = -(-limits.max_tokens // max(min_block_size, 1)) + 2
    return 16 + limits.num_groups * (1 + per_group)


def sign(key: bytes, raw: Mapping[str, Any]) -> str | None:
    """The ``mac`` of an entry (its JSON, ``mac`` left out)."""
    data = entry.canonical(raw)
    if data is None:
        return None
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verifies(key: bytes, raw: Mapping[str, Any]) -> bool:
    """Whether ``raw`` carries the MAC ``key`` gives it (constant-time compare)."""
    theirs = raw.get("mac")
    mine = sign(key, raw)
    if not isinstance(theirs, str) or mine is None:
        return False
    return hmac.compare_digest(mine.encode("ascii"), theirs.encode("ascii", "replace"))


def key_from_env(variable: str | None) -> bytes | None:
    """The shared key, read once at start-up from the environment variable
    ``variable`` names (``entry_key_env``); None when no variable is named.

    Raises:
        ValueError: the variable is named but unset or empty.
    """
    if variable is None:
        return None
    value = os.environ.get(variable, "")
    if not value:
        raise ValueError(
            f"{KEY_ENV_FIELD}: names the environment variable {variable}, which is "
            f"{'empty' if variable in os.environ else 'not set'} in this process; set "
            f"{variable} to the shared key on every producer and consumer (the same value), "
            "or remove entry_key_env"
        )
    return value.encode("utf-8")
