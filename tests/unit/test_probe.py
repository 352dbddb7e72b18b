"""``probe_items`` (``probe_stale_tails``) against counts taken by slicing."""

from __future__ import annotations

import numpy as np
import torch

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.core.probe import probe_items


def _sliced(view: torch.Tensor, pages: int, block: int, first: int) -> tuple[int, int]:
    """Non-zero bytes and non-finite values of slots [first, P*N) of ``block``
    of a ``[B, H, N, C]`` view, slot by slot."""
    n = view.shape[2]
    nonzero = nonfinite = 0
    for slot in range(first, pages * n):
        part = view[block * pages + slot // n, :, slot % n, :].contiguous()
        nonzero += int(part.view(torch.uint8).count_nonzero())
        nonfinite += int((~torch.isfinite(part.float())).sum())
    return nonzero, nonfinite


def test_probe_counts_what_slicing_counts():
    gen = torch.Generator().manual_seed(7)
    backing = torch.randn(8, 2, 4, 16, generator=gen).to(torch.float16)
    backing[backing > 1.0] = float("nan")
    backing[backing < -1.0] = 0
    view = backing[:, :, :, 4:12]  # padding on both sides of each slot's run
    items = np.array([[0, 1, 3], [0, 2, 5], [1, 3, 0]])
    sets = [CacheSet(0, 2, 1, [view]), CacheSet(1, 1, 1, [view])]
    found = probe_items(sets, items, ["a", "a", "b"])
    a1, a2 = _sliced(view, 2, 1, 3), _sliced(view, 2, 2, 5)
    assert found == {"a": (a1[0] + a2[0], a1[1] + a2[1]), "b": _sliced(view, 1, 3, 0)}
    assert found["a"][1] > 0 and found["b"][0] > 0  # the case counts something


def test_probe_counts_whole_pages_of_dense_caches():
    # No padding: a whole kernel page (first slot 0 of it) is gathered as a row.
    gen = torch.Generator().manual_seed(8)
    view = torch.randn(8, 2, 4, 8, generator=gen).to(torch.float16)
    view[view > 1.0] = float("nan")
    items = np.array([[0, 1, 0], [0, 2, 2], [0, 3, 5]])
    found = probe_items([CacheSet(0, 2, 1, [view])], items, ["a", "b", "c"])
    assert found == {
        "a": _sliced(view, 2, 1, 0),
        "b": _sliced(view, 2, 2, 2),
        "c": _sliced(view, 2, 3, 5),
    }
    assert found["a"][1] > 0  # the case counts something


def test_an_empty_view_counts_nothing_of_the_storage_it_sits_in():
    # H = 0 inside a live buffer: a real address, no bytes of its own.
    big = torch.ones(256)
    empty = big.as_strided((4, 0, 4, 8), (64, 32, 8, 1), 0)
    own = torch.zeros(4, 2, 4, 0)
    found = probe_items([CacheSet(0, 1, 1, [empty, own])], np.array([[0, 1, 1]]), ["r"])
    assert found == {"r": (0, 0)}
