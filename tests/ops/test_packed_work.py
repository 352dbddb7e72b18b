"""The worker's work encoded ahead: lines packed where each item becomes known
(``pack_line`` with ``KVZeroer.rows_for``), joined per step and launched
under the widest shapes of any group (``KVZeroer.zero_packed``), zero
exactly what the reference does; and ``packed_work`` lays out what the
numpy encoding of ``KVZeroer.zero`` does."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvtail_connector.ops import KVZeroer, reference_zero_kv_blocks
from kvtail_connector.ops.zero.plan import (
    ITEM_STRUCT,
    GroupRows,
    WorkShape,
    items_work,
    pack_line,
    packed_work,
)
from kvtail_connector.ops.zero.work_schema import HEADER_WORDS, WorkHeader
from tests.helpers.layouts import make_backing, rebase, to_device
from tests.ops.test_zero_kv_blocks import INTERPRET

needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs Triton"
)


def _packed(zeroer: KVZeroer, items: list[tuple[int, int, int]]) -> tuple[bytes, bytes]:
    """``items`` packed one by one, as the worker does, whole blocks apart."""
    whole, tails = [], []
    for group, block, first in items:
        rows = zeroer.rows_for(group, first)
        assert rows is not None
        (tails if first else whole).append(pack_line(block, first, rows))
    return b"".join(whole), b"".join(tails)


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_packed_lines_equal_the_numpy_encoding_of_the_same_items(n):
    rng = random.Random(n)
    items = np.array(
        [(rng.randrange(3), rng.randrange(10_000), rng.choice((0, rng.randrange(1, 64))))
         for _ in range(n)],
        dtype=np.int64,
    )  # fmt: skip
    # Group g's tail rows are range g, its whole-block rows range 3 + g.
    start = np.array([0, 4, 9, 12, 13, 15], dtype=np.int64)
    count = np.array([4, 5, 3, 1, 2, 1], dtype=np.int64)
    span = np.array([700, 3000, 10, 5000, 4096, 20], dtype=np.int64)
    by_numpy, units = items_work(items, start, count, span, 3, 2048)

    whole, tails = [], []
    for group, block, first in items.tolist():
        at = group + (3 if first == 0 else 0)
        rows = GroupRows(int(start[at]), int(count[at]), -(-int(span[at]) // 2048))
        (tails if first else whole).append(pack_line(block, first, rows))
    whole_at = items[items[:, 2] == 0][:, 0] + 3
    tail_at = items[items[:, 2] != 0][:, 0]

    def shape(at: np.ndarray) -> WorkShape:
        if not len(at):
            return WorkShape(0, 0)
        return WorkShape(int(count[at].max()), -(-int(span[at].max()) // 2048))

    by_line, line_units = packed_work(
        b"".join(whole), b"".join(tails), shape(whole_at), shape(tail_at)
    )
    assert by_line == by_numpy and line_units == units
    header = WorkHeader(*np.frombuffer(by_line[: 8 * len(WorkHeader._fields)], np.int64).tolist())
    assert header.n_whole == len(whole) and header.n_tail == len(tails)
    assert len(by_line) == 8 * HEADER_WORDS + ITEM_STRUCT.size * n


@needs_triton
@pytest.mark.parametrize("n_items", [1, 9])
def test_packed_lines_under_the_widest_shapes_zero_exactly_the_reference(n_items):
    # Groups of different row counts and spans; every launch's header says the
    # widest shapes of any group, not its lines'. On CPU caches (the
    # interpreter) the Triton path stages the work; on CUDA ones it replays a
    # graph slot.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = make_backing(
        "LBHNC", num_layers=1, num_pages=16, heads=1, slots=16, content=8, dtype=torch.bfloat16
    )
    large = make_backing(
        "LBHNC", num_layers=3, num_pages=16, heads=2, slots=16, content=64, dtype=torch.float16
    )
    on_small, on_large = to_device(small, device), to_device(large, device)
    zeroer = KVZeroer([(on_small.views, 1), (on_large.views, 1)], implementation="triton")
    assert zeroer.launches_packed
    rng = random.Random(n_items)
    expected = {0: small.raw.clone(), 1: large.raw.clone()}
    items = [(rng.randrange(2), rng.randrange(16), rng.randrange(0, 16)) for _ in range(n_items)]
    items = list({(g, b): (g, b, f) for g, b, f in items}.values())  # one item per block
    zeroer.zero_packed(*_packed(zeroer, items))
    for g, b, f in items:
        backing = (small, large)[g]
        reference_zero_kv_blocks(rebase(backing.views, expected[g]), tails=[(b, f)])
    assert torch.equal(on_small.raw.cpu(), expected[0])
    assert torch.equal(on_large.raw.cpu(), expected[1])


@pytest.mark.gpu
def test_graph_slots_replay_only_the_lines_of_each_launch():
    # More launches than graph slots, each shorter than the one before: a
    # reused slot's buffer still holds an older launch's lines past the new
    # ones, which the header must not count.
    backing = make_backing(
        "LBHNC", num_layers=3, num_pages=32, heads=2, slots=16, content=64, dtype=torch.bfloat16
    )
    dev = to_device(backing, "cuda")
    zeroer = KVZeroer([(dev.views, 1)])
    zeroer.warmup()
    assert zeroer.uses_graphs
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        # Fresh bytes each step: a line replayed from an older launch would zero some.
        noise = torch.randint(1, 127, backing.raw.shape, dtype=torch.int8, generator=gen)
        expected = noise.view(backing.raw.dtype).clone()
        dev.raw.copy_(expected)
        tails = [(b, 1 + (b + step) % 15) for b in range(step, 32, 2 + step)]
        zeroer.zero_packed(*_packed(zeroer, [(0, b, f) for b, f in tails]))
        torch.cuda.synchronize()
        reference_zero_kv_blocks(rebase(backing.views, expected), tails=tails)
        assert torch.equal(dev.raw.cpu(), expected), step
