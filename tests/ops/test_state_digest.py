"""The state-group digest (``mix64-state-1``) against an independent reference
(needs no vLLM: the GPU machine runs it; the parts that use it are tested in
``tests/unit/test_state_digest_parts.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtail_connector.extras.ops.state_digest import StateDigester, StateLayer
from kvtail_connector.extras.ops.state_digest.launcher import MODE_BYTES, MODE_VECTORS, MODE_WORDS

MASK = (1 << 64) - 1
WORD_MUL = 0xBF58476D1CE4E5B9


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    return x ^ (x >> 33)


def _reference(group: int, layers: list[StateLayer], block: int, shard: int) -> int:
    """The definition, over the page's raw bytes with numpy and Python ints."""
    seed = int.from_bytes(b"mix64-s1", "little")
    total = 0
    for li, layer in enumerate(layers):
        page = layer.pages[block].numpy().tobytes()
        for si, (offset, nbytes) in enumerate(layer.states):
            data = page[offset : offset + nbytes]
            data += b"\0" * (-len(data) % 4)
            words = np.frombuffer(data, dtype="<u4")
            plane = _fmix(_fmix(_fmix(_fmix(seed ^ group) ^ li) ^ si) ^ shard)
            for w, x in enumerate(words.tolist()):
                total += _fmix(((plane + w * WORD_MUL) & MASK) ^ x)
    return total & MASK


def _layers(seed: int, blocks: int = 6) -> list[StateLayer]:
    """Two layers: a bf16 conv state with an odd element count (a partial
    word) and a float32 SSM state, packed from offset 0 of padded pages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        pages = torch.randint(0, 256, (blocks, 96), dtype=torch.uint8, generator=g)
        out.append(StateLayer(pages, ((0, 3 * 5 * 2), (30, 4 * 4 * 4))))
    return out


def test_sums_match_the_reference_per_request_and_group() -> None:
    a, b = _layers(1), _layers(2)
    digester = StateDigester([(1, a), (3, b)], shard=2)
    blocks = [[4, 0], [None, 5], [2, None]]
    got = digester.digest(blocks)
    for i, per in enumerate(blocks):
        for j, (gid, layers) in enumerate(((1, a), (3, b))):
            want = 0 if per[j] is None else _reference(gid, layers, per[j], 2)
            assert int(got[i, j]) & MASK == want, (i, j)


# Both paths where they can run here: the kernel on CUDA or under the
# interpreter (tests/conftest.py sets it without CUDA), torch everywhere.
# These tests hold states in CPU memory: the Triton path runs them through the
# interpreter (CI); where it is off (a GPU machine), the CUDA test covers it.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
IMPLEMENTATIONS = ["torch", "triton"] if INTERPRETING else ["torch"]


def _states_layers(
    seed: int, specs: list[tuple[int, list[tuple[torch.dtype, tuple[int, ...]]]]], blocks: int
) -> list[StateLayer]:
    """Layers whose states (dtype, shape) are packed from ``start`` of a
    page padded past them, filled with random values of each dtype's width."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for start, states in specs:
        spans, offset = [], start
        for dtype, shape in states:
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            spans.append((offset, nbytes))
            offset += nbytes
        page = -(-(offset + 5) // 16) * 16
        pages = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=g)
        out.append(StateLayer(pages, tuple(spans)))
    return out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_dtype_alignment_and_chunking_matches_the_reference(implementation: str) -> None:
    # Group 2: GDN-like conv (bf16, odd count: a partial last word) and
    # recurrent (fp32) states; group 5: Mamba2-like with an fp16 SSM state, an
    # int8 state of 1-3 trailing bytes, and a layer whose states start
    # unaligned (byte loads); chunk and tile sizes small so that states span
    # several chunks, tiles and partial tiles.
    gdn = _states_layers(
        11,
        [(0, [(torch.bfloat16, (3, 7)), (torch.float32, (2, 6, 6))])] * 3,
        blocks=9,
    )
    mamba = _states_layers(
        12,
        [
            (0, [(torch.float16, (5, 3)), (torch.int8, (13,)), (torch.float32, (4, 4))]),
            (3, [(torch.bfloat16, (9,)), (torch.int8, (2,))]),
            (16, [(torch.float32, (7,)), (torch.int8, (1,))]),
        ],
        blocks=9,
    )
    groups = [(2, gdn), (5, mamba)]
    digester = StateDigester(
        groups, shard=3, implementation=implementation, chunk_words=8, tile_words=4
    )
    blocks: list[list[int | None]] = [[b % 9, (7 * b + 2) % 9] for b in range(20)]
    blocks[4][0] = None
    blocks[7][1] = None
    blocks[9] = [None, None]
    got = digester.digest(blocks)
    assert got.shape == (20, 2)
    for i, per in enumerate(blocks):
        for j, (gid, layers) in enumerate(groups):
            want = 0 if per[j] is None else _reference(gid, layers, per[j], 3)
            assert int(got[i, j]) & MASK == want, (i, j)


@pytest.mark.gpu
def test_the_kernel_on_cuda_matches_the_reference() -> None:
    # Real loads (vectors, words, bytes) and a GDN-sized state that spans
    # many full tiles and chunks, with the default work split.
    layers = _states_layers(
        16,
        [
            (0, [(torch.bfloat16, (64, 3)), (torch.float32, (2, 64, 64))]),
            (4, [(torch.float16, (33,)), (torch.int8, (7,))]),
            (1, [(torch.bfloat16, (2, 1000)), (torch.float32, (3,))]),
        ],
        blocks=5,
    )
    cuda = [StateLayer(layer.pages.cuda(), layer.states) for layer in layers]
    digester = StateDigester([(3, cuda)], shard=2)
    assert digester.implementation == "triton"
    blocks: list[list[int | None]] = [[4], [None], [0], [4]]
    got = digester.digest(blocks).cpu()
    for i, per in enumerate(blocks):
        want = 0 if per[0] is None else _reference(3, layers, per[0], 2)
        assert int(got[i, 0]) & MASK == want, i


@pytest.mark.skipif(not INTERPRETING, reason="CPU states: the Triton path needs the interpreter")
def test_the_kernel_loads_by_alignment() -> None:
    layers = _states_layers(13, [(0, [(torch.float32, (8,))]), (4, [(torch.float32, (8,))])], 4)
    layers.append(StateLayer(layers[0].pages[:, 1:], ((0, 8),)))
    digester = StateDigester([(0, layers)], shard=0, implementation="triton")
    assert digester._units is not None
    modes = digester._units[:, 6].tolist()
    assert modes == [MODE_VECTORS, MODE_WORDS, MODE_BYTES]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_many_requests_and_repeated_calls(implementation: str) -> None:
    layers = _states_layers(14, [(0, [(torch.bfloat16, (5,)), (torch.float32, (3, 3))])] * 2, 40)
    digester = StateDigester([(4, layers)], shard=1, implementation=implementation)
    blocks: list[list[int | None]] = [[(b * 17) % 40] for b in range(40)]
    want = [_reference(4, layers, per[0], 1) for per in blocks]
    for _ in range(2):  # the output is zeroed per call, not accumulated
        got = digester.digest(blocks)
        assert [int(v) & MASK for v in got[:, 0]] == want
    assert digester.digest([]).shape == (0, 1)
    assert int(digester.digest([[None]])[0, 0]) == 0


def test_a_block_outside_the_pages_is_refused() -> None:
    layers = _states_layers(15, [(0, [(torch.float32, (4,))])], 3)
    digester = StateDigester([(0, layers)], shard=0)
    with pytest.raises(ValueError, match=r"blocks\[1\]\[0\]: block 3 outside"):
        digester.digest([[0], [3]])
    with pytest.raises(ValueError, match="expected 1 entries"):
        digester.digest([[0, 1]])


def test_placement_does_not_change_the_sum_and_any_byte_does() -> None:
    a = _layers(3)
    copy = [StateLayer(layer.pages.roll(2, dims=0).clone(), layer.states) for layer in a]
    here = StateDigester([(0, a)], shard=0).digest([[1]])
    there = StateDigester([(0, copy)], shard=0).digest([[3]])  # the same page, block 3
    assert int(here[0, 0]) == int(there[0, 0])
    assert int(StateDigester([(0, a)], shard=1).digest([[1]])[0, 0]) != int(here[0, 0])
    for layer, byte in ((0, 0), (1, 29), (1, 30 + 63)):
        copy[layer].pages[3, byte] ^= 0x10
        assert int(StateDigester([(0, copy)], shard=0).digest([[3]])[0, 0]) != int(here[0, 0])
        copy[layer].pages[3, byte] ^= 0x10
    # Padding past the states is not digested.
    copy[0].pages[3, 95] ^= 0xFF
    assert int(StateDigester([(0, copy)], shard=0).digest([[3]])[0, 0]) == int(here[0, 0])


def test_a_state_that_does_not_fit_its_page_is_refused() -> None:
    pages = torch.zeros((2, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        StateDigester([(0, [StateLayer(pages, ((8, 12),))])], shard=0)
