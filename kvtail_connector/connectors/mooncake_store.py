"""MooncakeStoreConnector: hits can end inside a block (prefix_match_unit)."""

from __future__ import annotations

from .base import InnerAdapter


class MooncakeStoreAdapter(InnerAdapter):
    """Store hits fill only the hit length of the last block (a multiple of
    ``prefix_match_unit``); the rest of it keeps its previous owner's bytes.
    Nothing about it is name-keyed in vLLM, so there is nothing to re-check."""
