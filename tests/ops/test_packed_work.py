"""The completion path's work buffers: written straight into a graph slot
(``fill_line_work``) or joined from bytes packed where each load arrived
(``fill_packed_work``), both equal to what ``line_work`` builds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvtail_connector.ops import reference_zero_kv_blocks
from kvtail_connector.ops.zero._step_zeroer import StepZeroer
from kvtail_connector.ops.zero.plan import (
    Line,
    fill_line_work,
    fill_packed_work,
    line_work,
    packed_lines,
)
from kvtail_connector.ops.zero.work_schema import HEADER_WORDS, ITEM_COLS
from tests.helpers.layouts import make_backing, rebase, to_device


def _lines(rng: random.Random, n: int, whole: bool) -> list[Line]:
    out = []
    for i in range(n):
        first = 0 if whole and i % 3 == 0 else rng.randrange(1, 64)
        rows, chunks = rng.randrange(1, 9), rng.randrange(1, 5)
        block = rng.randrange(0, 10_000)
        out.append(
            Line(
                (rng.randrange(3), block, first),
                (block, first, rng.randrange(40), rows),
                rows,
                chunks,
            )
        )
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("whole", [False, True], ids=["tails", "with whole blocks"])
def test_filled_buffers_equal_line_work(n, whole):
    rng = random.Random(n * 2 + whole)
    lines = _lines(rng, n, whole)
    work, units = line_work(lines)
    junk = np.full(HEADER_WORDS + ITEM_COLS * n + 5, -7, dtype=np.int64)  # a slot's old bytes
    assert fill_line_work(junk, lines) == units
    assert np.array_equal(junk[: work.size], work)
    if not whole:
        # Packed per load (a few lines each), joined per step, in any split.
        cuts = sorted(rng.sample(range(1, n), min(n - 1, 3))) if n > 1 else []
        parts = [lines[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        packed = b"".join(packed_lines(p) for p in parts)
        junk[:] = -7
        rows, chunks = max(ln.rows for ln in lines), max(ln.chunks for ln in lines)
        assert fill_packed_work(junk.data.cast("B"), packed, n, rows, chunks) == units
        assert np.array_equal(junk[: work.size], work)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["packed", "lines"])
def test_graph_slot_paths_zero_exactly_what_the_reference_does(path):
    backing = make_backing(
        "LBHNC", num_layers=3, num_pages=32, heads=2, slots=16, content=64, dtype=torch.bfloat16
    )
    dev = to_device(backing, "cuda")
    zeroer = StepZeroer([(dev.views, 1)])
    zeroer.warmup()
    assert zeroer.uses_graphs
    expected = backing.raw.clone()
    for step in range(6):  # more steps than graph slots: each slot reused
        tails = [(b, 1 + (b + step) % 15) for b in range(step, 32, 5)]
        lines = [zeroer.line(0, b, f) for b, f in tails]
        assert all(ln is not None for ln in lines)
        if path == "packed":
            zeroer.zero_packed(
                packed_lines(lines),
                len(lines),
                max(ln.rows for ln in lines),
                max(ln.chunks for ln in lines),
            )
        else:
            zeroer.zero_lines(lines)
        reference_zero_kv_blocks(rebase(backing.views, expected), tails=tails)
    torch.cuda.synchronize()
    assert torch.equal(dev.raw.cpu(), expected)


def test_packed_bytes_must_cover_every_line_the_header_counts():
    # A slot's buffer keeps an older step's lines past what is written: a
    # header counting more lines than the bytes hold would replay them.
    rng = random.Random(3)
    old, fresh = _lines(rng, 2, False), _lines(rng, 1, False)
    buf = np.zeros(HEADER_WORDS + ITEM_COLS * 4, dtype=np.int64)
    fill_packed_work(buf.data.cast("B"), packed_lines(old), 2, 8, 4)
    with pytest.raises(ValueError, match="packed"):
        fill_packed_work(buf.data.cast("B"), packed_lines(fresh), 2, 8, 4)


@pytest.mark.parametrize("n_tails", [1, 9])
def test_packed_lines_under_the_widest_tail_shape_zero_exactly_the_reference(n_tails):
    # Groups of different row counts and spans; every step's header says the
    # widest tail shape of any group (StepZeroer.tail_shape), not its lines'.
    # On CPU caches (the interpreter) the Triton path stages the work; on CUDA
    # ones it replays a graph slot.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = make_backing(
        "LBHNC", num_layers=1, num_pages=16, heads=1, slots=16, content=8, dtype=torch.bfloat16
    )
    large = make_backing(
        "LBHNC", num_layers=3, num_pages=16, heads=2, slots=16, content=64, dtype=torch.float16
    )
    on_small, on_large = to_device(small, device), to_device(large, device)
    zeroer = StepZeroer([(on_small.views, 1), (on_large.views, 1)], implementation="triton")
    assert zeroer.launches_packed
    rows, chunks = zeroer.tail_shape()
    rng = random.Random(n_tails)
    expected = {0: small.raw.clone(), 1: large.raw.clone()}
    tails = [(rng.randrange(2), rng.randrange(16), rng.randrange(1, 16)) for _ in range(n_tails)]
    tails = list({(g, b): (g, b, f) for g, b, f in tails}.values())  # one line per block
    lines = [zeroer.line(*t) for t in tails]
    assert all(ln is not None for ln in lines)
    assert rows >= max(ln.rows for ln in lines) and chunks >= max(ln.chunks for ln in lines)
    zeroer.zero_packed(packed_lines(lines), len(lines), rows, chunks)
    for g, b, f in tails:
        backing = (small, large)[g]
        reference_zero_kv_blocks(rebase(backing.views, expected[g]), tails=[(b, f)])
    assert torch.equal(on_small.raw.cpu(), expected[0])
    assert torch.equal(on_large.raw.cpu(), expected[1])
