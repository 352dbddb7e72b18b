"""OpenAI clients through ``vllm-router``, against real API servers.

(a) 48 prompts of random lengths, half ending inside a block (by construction,
    with the block size the engine reports), completions and chats, streamed and
    not, 8 at a time: through the plain pair and the wrapped pair, every greedy
    answer equals the single-engine server's, and the wrapped decode server's
    ``/metrics`` count one zeroed, probed tail per mid-block prompt, the bytes
    those tails hold, no failure, and nothing held afterwards.
(b) NaN planted in the producer's never-written tail slots after each prefill
    (by a tap between the router and the prefill server, before the router sends
    the decode leg):
    the plain pair delivers it (NaN in the decode server's cache, answers that
    differ), the wrapped pair zeroes it (no NaN, answers equal, the probe counts
    exactly the NaN planted).
"""

from __future__ import annotations

import pytest

from demo.faults import PoisonTail
from demo.prefill_tap import PrefillTap
from demo.router import Router
from demo.serving import ServePair
from demo.workload import Prompt, openai_client, send, send_all
from tests.serve.conftest import Servers
from tests.serve.support import (
    CONCURRENCY,
    MAX_TOKENS,
    block_size,
    elements_per_slot,
    expected_tail_bytes,
    kvtail,
    mismatches,
    references,
    served_prompts,
    slot_bytes,
    wait_counts,
    wait_idle,
)

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def bs(servers: Servers) -> int:
    sizes = {block_size(s) for s in servers.fleet.servers()}
    assert len(sizes) == 1, sizes
    return sizes.pop()


def _prompts(servers: Servers, count: int, bs: int, seed: int) -> list[Prompt]:
    return served_prompts(servers.reference, count, bs, seed=seed)


@pytest.fixture(scope="module", autouse=True)
def _stop_plain_pair(servers: Servers):
    yield
    servers.fleet.close_pair("plain")  # the fault tests need only the wrapped pair


def _through(servers: Servers, pair: ServePair, prompts: list[Prompt]):
    log_dir = servers.fleet.log_dir
    with Router(pair.name, [pair.prefill.url], [pair.decode.url], log_dir) as router:
        return send_all(openai_client(router.url), prompts, MAX_TOKENS, CONCURRENCY)


def test_concurrent_clients_equal_the_single_engine(servers: Servers, bs: int) -> None:
    prompts = _prompts(servers, 48, bs, seed=1)
    mid = [p for p in prompts if p.mid_block(bs)]
    assert len(mid) == len(prompts) // 2
    assert {(p.kind, p.stream) for p in mid} == {(p.kind, p.stream) for p in prompts}
    refs = references(servers.reference, prompts)
    # The lengths the engine saw are the lengths the prompts were built with.
    assert [len(r.prompt_token_ids or ()) for r in refs] == [p.num_tokens for p in prompts]

    plain = _through(servers, servers.plain, prompts)
    assert mismatches(plain, refs) == []

    d = servers.wrapped.decode
    before, p_before = kvtail(d), kvtail(servers.wrapped.prefill)
    wrapped = _through(servers, servers.wrapped, prompts)
    assert mismatches(wrapped, refs) == []
    # Both servers run the wrapper: P zeroed every mid-block tail and vouched for
    # it, the entry crossed vllm-router (which copies the prefill answer's
    # kv_transfer_params whole) bound to its transfer, and D (vouch_tails
    # "auto") checked each claim and zeroed the tail itself anyway (its probe
    # found each one already zero).
    want = {
        "tails_vouched": 0,  # counted on P
        "vouched_tails": 0,
        "vouches_unused": len(mid),
        "vouches_declined": 0,
        "tails_zeroed": len(mid),
        "tail_bytes_zeroed": expected_tail_bytes(prompts, bs, slot_bytes(d)),
        "stale_nonzero_bytes": 0,
        "probed_tails": len(mid),
        "false_vouches": 0,
        "failed_loads": 0,
        "stale_nonfinite_values": 0,
    }
    got = wait_counts(d, before, want)
    assert got["held_requests"] == 0, got
    assert d.nan_census() == {}
    p_got = wait_counts(servers.wrapped.prefill, p_before, {"tails_vouched": len(prompts)})
    assert p_got["producer_tail_bytes_zeroed"] == expected_tail_bytes(prompts, bs, slot_bytes(d))


def _poisoned(servers: Servers, pair: ServePair, prompts: list[Prompt], bs: int):
    """Each prompt alone (poison must not reach another request's blocks), NaN in
    the producer's tail; returns (answers, NaN census of D after each, poison hook)."""
    hook = PoisonTail(pair.prefill, bs)
    answers, census = [], []
    with (
        PrefillTap(pair.prefill.url) as tap,
        Router(f"{pair.name}-tap", [tap.url], [pair.decode.url], servers.fleet.log_dir) as router,
    ):
        tap.after_prefill = hook
        client = openai_client(router.url)
        for p in prompts:
            try:
                answers.append(send(client, p, MAX_TOKENS))
                wait_idle(pair.decode)
                census.append(pair.decode.nan_census())
            finally:
                pair.prefill.scrub_nan()
                pair.decode.scrub_nan()
    return answers, census, hook


def test_planted_nan_tail_breaks_the_plain_pair_not_the_wrapped_one(
    servers: Servers, bs: int
) -> None:
    prompts = [p for p in _prompts(servers, 16, bs, seed=2) if p.mid_block(bs)]
    refs = references(servers.reference, prompts)

    plain, plain_census, plain_hook = _poisoned(servers, servers.plain, prompts, bs)
    assert all(plain_hook.planted), plain_hook.planted
    assert all(plain_census), "the plain pair must deliver the NaN tail"
    assert len(mismatches(plain, refs)) == len(prompts), "every poisoned answer must differ"

    d = servers.wrapped.decode
    before = kvtail(d)
    wrapped, census, hook = _poisoned(servers, servers.wrapped, prompts, bs)
    assert all(hook.planted), hook.planted
    assert census == [{}] * len(prompts)
    assert mismatches(wrapped, refs) == []
    # The NaN was planted after P vouched for a clean tail: D (vouch_tails
    # "auto") does not skip on the claim, zeroes every tail itself and its probe
    # counts the NaN; no vouched tail, so no false vouch.
    want = {
        "tails_zeroed": len(prompts),
        "probed_tails": len(prompts),
        "vouches_unused": len(prompts),
        "false_vouches": 0,
        "vouched_tails": 0,
        "stale_nonfinite_values": sum(hook.planted) * elements_per_slot(d),
        "tail_bytes_zeroed": expected_tail_bytes(prompts, bs, slot_bytes(d)),
        "failed_loads": 0,
    }
    got = wait_counts(d, before, want)
    assert got["held_requests"] == 0, got
