"""Page maps: the layouts the wrapper has established, and the one decision
that picks a layer's map or refuses the layer.

A :class:`PageMap` covers the layers of some backends whose spec it has read
field by field, and says which bytes each token slot of their pages owns
(the plain view, or a :class:`~kvtail_connector.ops.RegionCache`). Every
layer whose tails are zeroed, probed or digested goes through
:func:`page_cache`: exactly one map covers it, or the engine stops at
start-up naming the layer. Nothing is zeroed by guess: a backend, a spec
class or a spec field no map knows is refused, never taken for plain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtail_connector.ops import RegionCache
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.spec_fields import NAMED, unknown_fields

PageCache = torch.Tensor | RegionCache

# What a refused layer's user can do, whatever the layout.
SETTINGS_THAT_WORK = (
    "serve the model with a page layout docs/compatibility.md lists as mapped "
    "(another --kv-cache-dtype or --attention-backend), or, where this model needs no "
    'tail zeroing, set kv_connector_extra_config.zero_tails to "off", verify_kv to "off" '
    "and probe_stale_tails to false (with MoRIIO READ on a model vLLM zeroes, the tails "
    "READs copy are still zeroed, so that does not help there)"
)


class UnmappedPage(ValueError):
    """A layer whose page layout no map has established: refused at start-up."""


@dataclass(frozen=True)
class PageMap:
    """One established page layout.

    Attributes:
        layout: its name, as ``docs/compatibility.md`` lists it.
        backends: class paths (``module.QualName``) of the attention
            backends whose pages it describes.
        covers: whether it describes this layer (read from the spec's
            fields and the layer; called only for the backends above).
        cache: the layer's cache for the zeroer, the probe and the digest:
            the view itself where token slot ``n`` owns exactly
            ``view[b, :, n, :]``, else a ``RegionCache``. Raises ValueError
            with the reason where the view is not the one the map expects.
        hint: for a layer of one of these backends that the map does not
            cover, the setting that would make it covered (or None).
    """

    layout: str
    backends: frozenset[str]
    covers: Callable[[LayerPage], bool]
    cache: Callable[[LayerPage], PageCache]
    hint: Callable[[LayerPage], str | None] = lambda page: None


def spec_summary(page: LayerPage) -> str:
    """The spec fields that shape ``page``, with their values (defaults left out)."""
    parts = []
    for name in NAMED:
        value = page.field(name)
        if value is None or value is False:
            continue
        if name == "kv_quant_mode":
            value = page.quant_mode
        elif name == "dtype":
            value = str(value).replace("torch.", "")
        parts.append(f"{name}={value}")
    return ", ".join(parts)


def _refuse(page: LayerPage, why: str, hints: Sequence[str] = ()) -> UnmappedPage:
    settings = "; ".join((*hints, SETTINGS_THAT_WORK))
    return UnmappedPage(
        f"KVTailConnector: {page.describe()}: {why}; spec: {spec_summary(page)}. Its token "
        "slots' bytes are not known, so its tails cannot be zeroed (or digested) without "
        f"risking valid KV. Settings that work: {settings}."
    )


def page_cache(page: LayerPage, maps: Sequence[PageMap]) -> PageCache:
    """The cache through which ``page``'s tails are zeroed, probed and digested.

    Raises:
        UnmappedPage: no map, or more than one, covers the layer, its spec
            holds a field no map knows, or its map rejects the view.
    """
    unknown = unknown_fields(page.spec)
    if unknown:
        fields = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        raise _refuse(page, f"its spec sets fields no page map knows ({fields})")
    path = page.backend_path
    if path is None:
        raise _refuse(page, "vLLM names no attention backend for it")
    candidates = [m for m in maps if path in m.backends]
    found = [m for m in candidates if m.covers(page)]
    if not found:
        hints = [h for h in (m.hint(page) for m in candidates) if h]
        raise _refuse(page, "no page map covers this backend with this spec", hints)
    if len(found) > 1:
        names = ", ".join(m.layout for m in found)
        raise _refuse(page, f"several page maps claim it ({names})")
    try:
        return found[0].cache(page)
    except ValueError as e:
        if isinstance(e, UnmappedPage):
            raise
        raise _refuse(page, f"{found[0].layout}: {str(e).rstrip('.')}") from e
