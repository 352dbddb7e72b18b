"""Hostile ``kv_transfer_params`` against a real decode API server.

Any client of D's OpenAI server can set ``kv_transfer_params``, and a router
hands D whatever P's answer held. Here a wrapped NIXL pair with ``verify_kv:
"digest"`` on both sides serves requests whose prefill answer is edited on
its way to D (a tap between vllm-router and P, ``after_prefill``): the ``kvtail``
entry D gets is crafted (the ``dg.seg = 2**63`` that made
``ops/digest/plan.py`` raise ``OverflowError`` inside ``get_transfer_results``
and ended the engine core), megabytes large, or of wrong types anywhere. The
transfer itself is real (P's binding keys are kept), so D's load completes and
the wrapper's reading of the entry is on the path. For every request D must
answer (the tokens P computes for the prompt, or a clean 4xx), stay healthy
(``/health``), count the refused digest (``digests_skipped``) and hold
nothing, and serve a clean P/D request right after, verified.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from demo.prefill_tap import PrefillTap
from demo.router import Router
from demo.serving import Fleet, ServePair
from demo.tiny_model import ensure_tiny_llama
from demo.workload import Answer, completion_prompt, openai_client, send
from kvtail_connector.extras import entry
from tests.e2e.support import require
from tests.serve.support import MAX_TOKENS, block_size, kvtail, wait_counts

pytestmark = pytest.mark.serve

# Far deeper than an entry may nest (8), within what vllm-router's JSON parser
# takes (serde_json stops at 128 levels: deeper, the router answers 500 itself
# and nothing reaches D).
DEEP: Any = "x"
for _ in range(100):
    DEEP = [DEEP]


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(kvtail: dict[str, Any]) -> Any:
        node = kvtail
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return kvtail

    return edit


# name -> what the entry D receives becomes (from P's real entry)
HOSTILE: dict[str, Callable[[dict[str, Any]], Any]] = {
    "seg-2**63": _set(("dg", "seg"), 2**63),
    "seg-not-for-n": _set(("dg", "seg"), 2048),
    "huge-entry": _set(("pad",), ["0" * 200] * 30_000),  # 6 MB
    "deep-nesting": _set(("pad",), DEEP),
    "n-huge": _set(("n",), 2**63 - 1),
    "n-string": _set(("n",), "37"),
    "n-bool": _set(("n",), True),
    "n-float": _set(("n",), 37.0),
    "v-bool": _set(("v",), True),
    "geom-null": _set(("geom",), None),
    "dg-g-number": _set(("dg", "g"), 7),
    "dg-sums-as-ints": _set(("dg", "g", "0", "0"), [2**64 - 1]),
    "dg-many-heads": _set(("dg", "g", "0"), {str(h): ["0" * 16] for h in range(100_000)}),
    "entry-string": lambda kvtail: "zero",
    "entry-list": lambda kvtail: [kvtail],
    "known-wrong-producer": _set(("pv",), "0.1.0"),
    "unknown-version": _set(("v",), 99),
}


@dataclass
class Routed:
    """The pair behind vllm-router, with a tap between the router and P."""

    pair: ServePair
    tap: PrefillTap
    router: Router


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    require("nixl._api")
    model = str(ensure_tiny_llama())
    fleet = Fleet(tmp_path_factory.mktemp("hostile-logs"))
    pair = fleet.add_pair("hostile", model, options={"verify_kv": "digest"})
    with (
        fleet.start(),
        PrefillTap(pair.prefill.url) as tap,
        Router(pair.name, [tap.url], [pair.decode.url], fleet.log_dir) as router,
    ):
        yield Routed(pair, tap, router)


def _through(routed: Routed, prompt: Any, edit: Callable[[dict[str, Any]], Any] | None) -> Answer:
    def hook(path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        params = answer["kv_transfer_params"]
        assert entry.KEY in params, "P sent no kvtail entry"
        if edit is not None:
            params[entry.KEY] = edit(params[entry.KEY])

    routed.tap.after_prefill = hook
    return send(openai_client(routed.router.url), prompt, MAX_TOKENS)


def _local(pair: ServePair, prompt: Any) -> Answer:
    """P computing the prompt itself: the tokens D must decode from P's KV."""
    answer = send(openai_client(pair.prefill.url), prompt, MAX_TOKENS)
    assert answer.error is None and len(answer.token_ids) == MAX_TOKENS, answer
    return answer


def _clean_4xx(answer: Answer) -> bool:
    import openai

    err = answer.error
    return isinstance(err, openai.APIStatusError) and 400 <= err.status_code < 500


def test_hostile_entries_never_take_the_decode_server_down(routed: Routed) -> None:
    pair = routed.pair
    d = pair.decode
    bs = block_size(d)
    rng = random.Random(7)
    # Distinct mid-block prompts: none can be answered from D's prefix cache.
    prompts = [completion_prompt(bs * 2 + 3 + i, rng, False) for i in range(len(HOSTILE) + 2)]
    clean_first, *hostile_prompts, clean_last = prompts

    before = kvtail(d)
    first = _through(routed, clean_first, None)
    assert first.error is None and first.token_ids == _local(pair, clean_first).token_ids
    wait_counts(d, before, {"digests_verified": 1, "digests_skipped": 0})

    before = kvtail(d)
    answered, refused = [], []
    for (name, edit), prompt in zip(HOSTILE.items(), hostile_prompts, strict=True):
        answer = _through(routed, prompt, edit)
        if answer.error is None:
            assert answer.token_ids == _local(pair, prompt).token_ids, name
            answered.append(name)
        else:
            assert _clean_4xx(answer), (name, repr(answer.error))
            refused.append(name)
        assert d.alive and d._healthy(), f"{name}: the decode server is down\n{d.log_tail()}"
    # The crafted segment reached D's load (vLLM takes a u64) and was refused there.
    assert "seg-2**63" in answered, refused
    # Every entry D got was refused whole or in its digest: nothing verified,
    # nothing failed, nothing held.
    got = wait_counts(
        d,
        before,
        {"digests_skipped": len(answered), "digests_verified": 0, "digest_mismatches": 0},
        timeout=120,
    )
    assert got.get("failed_loads", 0) == 0 and got["held_requests"] == 0, got
    assert d.nan_census() == {}

    # A clean P/D request right after: served, verified.
    before = kvtail(d)
    last = _through(routed, clean_last, None)
    assert last.error is None and last.token_ids == _local(pair, clean_last).token_ids
    wait_counts(d, before, {"digests_verified": 1, "digests_skipped": 0})
