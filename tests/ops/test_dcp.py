"""dcp_local_valid_slots against a brute-force count of vLLM's token dealing."""

import pytest

from kvtail_connector import dcp_local_valid_slots


def brute_force(num_tokens, rank, world, interleave):
    # vLLM deals offset t of a virtual block to rank (t // I) % W.
    return sum(1 for t in range(num_tokens) if (t // interleave) % world == rank)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_matches_brute_force_for_every_interleave(world):
    block = 16  # rank-local slots per block
    for interleave in range(1, block + 1):
        if block % interleave:
            continue  # vLLM requires block_size % interleave == 0
        virtual = block * world
        for n in range(virtual + 1):
            for rank in range(world):
                assert dcp_local_valid_slots(n, rank, world, interleave) == brute_force(
                    n, rank, world, interleave
                ), (n, rank, world, interleave)


def test_slots_of_all_ranks_add_up_to_the_tokens():
    for n in range(0, 200, 7):
        assert sum(dcp_local_valid_slots(n, r, 4, 3) for r in range(4)) == n


def test_dcp8_mla_case():
    # DCP8 MLA: 1,536 rank-local slots per block -> 12,288-token virtual blocks;
    # 275,089 loaded tokens leave 4,753 in the last block.
    n = 275_089 % (1536 * 8)
    assert n == 4753
    assert dcp_local_valid_slots(n, 0, 8, 1) == 595
    assert [dcp_local_valid_slots(n, r, 8, 1) for r in range(1, 8)] == [594] * 7
    assert [dcp_local_valid_slots(n, r, 8, 1) for r in range(8)] == [
        brute_force(n, r, 8, 1) for r in range(8)
    ]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 0, 1, 1), "num_tokens: must be >= 0"),
        ((5, 2, 2, 1), "dcp_rank: must be < dcp_world_size=2"),
        ((5, -1, 2, 1), "dcp_rank: must be >= 0"),
        ((5, 0, 0, 1), "dcp_world_size: must be >= 1"),
        ((5, 0, 1, 0), "interleave: must be >= 1"),
        ((5.0, 0, 1, 1), "num_tokens: expected an int"),
        ((True, 0, 1, 1), "num_tokens: expected an int"),
    ],
)
def test_invalid_arguments_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        dcp_local_valid_slots(*args)


def test_worker_inlined_count_matches_the_public_function():
    from fractions import Fraction

    from kvtail_connector.core.tails import first_stale_slot

    for world, interleave in ((1, 1), (2, 1), (4, 3), (8, 1), (8, 16)):
        for n in range(0, 200, 7):
            for rank in range(world):
                local = dcp_local_valid_slots(n, rank, world, interleave)
                for tps in (1, 2, 4, Fraction(1, 2), Fraction(3, 2)):
                    got = first_stale_slot(
                        n,
                        dcp_rank=rank,
                        dcp_world_size=world,
                        interleave=interleave,
                        tokens_per_state=tps,
                    )
                    # floor(local / tps): a partially covered state is stale.
                    assert got == int(Fraction(local) / Fraction(tps)), (n, rank, world, tps)
