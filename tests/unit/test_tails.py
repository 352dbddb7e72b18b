"""Tail arithmetic at the boundaries that matter."""

from fractions import Fraction

from kvtail_connector.core.tails import first_stale_slot, tail_block


def test_block_aligned_loads_have_no_tail():
    assert tail_block(64, 16) is None
    assert tail_block(70, 16) == (4, 6)
    assert tail_block(15_000, 12_288) == (1, 2712)


def test_compressed_state_written_only_when_its_tokens_complete():
    # DeepSeek-V4's compressor stores state s when token (s+1)*ratio-1 arrives,
    # so with 7 tokens of ratio 4 state 1 is unwritten (stale) and is zeroed;
    # with 8 tokens it is complete and kept.
    kw = dict(dcp_rank=0, dcp_world_size=1, interleave=1, tokens_per_state=4)
    assert first_stale_slot(7, **kw) == 1
    assert first_stale_slot(8, **kw) == 2
    assert first_stale_slot(3, **kw) == 0


def test_several_states_per_token_count_exactly():
    kw = dict(dcp_rank=0, dcp_world_size=1, interleave=1, tokens_per_state=Fraction(1, 4))
    assert first_stale_slot(5, **kw) == 20
