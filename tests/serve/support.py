"""Helpers of the serving tests: polling, metrics, references, comparisons."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from demo import procs
from demo.api_server import APIServer
from demo.prom_text import delta, info_label, kvtail_values, total
from demo.router import Router
from demo.workload import Answer, Prompt, mixed_prompts, openai_client, send, send_all

T = TypeVar("T")
MAX_TOKENS = 12
CONCURRENCY = 8


def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    """Poll ``pred`` until it returns something truthy; its last value on timeout
    goes into the (assertion) error."""
    try:
        return procs.wait_for(pred, timeout, what, interval=interval)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None


def block_size(server: APIServer) -> int:
    """The block size the engine reports (``vllm:cache_config_info``)."""
    return int(info_label(server.metrics(), "vllm:cache_config_info", "block_size"))


def kvtail(server: APIServer) -> dict[str, float]:
    return kvtail_values(server.metrics())


def slot_bytes(server: APIServer) -> int:
    """Bytes of one token slot over every attention layer (K and V, all heads)."""
    layers = server.layout()
    sizes = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}
    return sum(v["elements_per_slot"] * sizes[v["dtype"]] for v in layers.values())


def elements_per_slot(server: APIServer) -> int:
    per = {v["elements_per_slot"] for v in server.layout().values()}
    assert len(per) == 1, per
    return per.pop()


def idle(server: APIServer) -> dict[str, float] | None:
    """The server's counters when it holds nothing: no request running or waiting,
    no KV fetch in any stage, and the wrapper (if any) holding no request."""
    m = server.metrics()
    busy = (
        total(m, "vllm:num_requests_running")
        + total(m, "vllm:num_requests_waiting")
        + total(m, "vllm:num_requests_kv_fetch_by_stage")
    )
    values = kvtail_values(m)
    if busy or values.get("held_requests", 0):
        return None
    return values or {"idle": 1.0}


def wait_idle(server: APIServer, timeout: float = 120.0) -> dict[str, float]:
    return wait_until(lambda: idle(server), timeout, f"{server.spec.name} idle")


def served_prompts(
    reference: APIServer, count: int, block_size: int, *, seed: int, low: int = 8, high: int = 200
) -> list[Prompt]:
    """``mixed_prompts`` whose chat lengths are counted by ``reference``'s own
    tokenizer and chat template (what the engine will see)."""

    def count_tokens(messages: list[dict[str, str]]) -> int:
        return len(reference.tokenize(messages=messages, add_generation_prompt=True))

    return mixed_prompts(count, block_size, count_tokens, seed=seed, low=low, high=high)


def references(reference: APIServer, prompts: Sequence[Prompt]) -> list[Answer]:
    """The single-engine answers (no proxy, no transfer)."""
    answers = send_all(openai_client(reference.url), prompts, MAX_TOKENS, CONCURRENCY)
    for a in answers:
        assert a.error is None, a.error
        assert len(a.token_ids) == MAX_TOKENS, a
    return answers


def mismatches(answers: Sequence[Answer], refs: Sequence[Answer]) -> list[str]:
    """Prompts whose answer is an error or differs from the reference."""
    out = []
    for i, (a, r) in enumerate(zip(answers, refs, strict=True)):
        if a.error is not None:
            out.append(f"#{i} {a.prompt.kind} stream={a.prompt.stream}: {a.error!r}")
        elif a.token_ids != r.token_ids or a.text != r.text:
            out.append(
                f"#{i} {a.prompt.kind} stream={a.prompt.stream}: {a.token_ids} != {r.token_ids}"
            )
    return out


def expected_tail_bytes(prompts: Sequence[Prompt], bs: int, per_slot: int) -> int:
    return sum((bs - p.num_tokens % bs) * per_slot for p in prompts if p.mid_block(bs))


def wait_counts(
    server: APIServer, before: dict[str, float], want: dict[str, float], timeout: float = 60.0
) -> dict[str, float]:
    """Wait until the server is idle and its ``vllm:kvtail_*`` values moved by
    ``want`` since ``before``; returns every delta."""

    def counted() -> dict[str, float] | None:
        got = delta(wait_idle(server), before)
        return got if all(got.get(k) == v for k, v in want.items()) else None

    try:
        return wait_until(counted, timeout, f"{server.spec.name} counters")
    except AssertionError as e:
        raise AssertionError(f"{e}; wanted {want}, got {delta(kvtail(server), before)}") from None


def router_with_prefill_dead(
    reference: APIServer, prefill: APIServer, router: Router, decode: APIServer, prompt: Prompt
) -> dict[str, Any]:
    """A router in front of the (dead) ``prefill`` server and ``decode``: the
    router's answer, that nothing reaches the decode server (which still serves
    what it computes itself), when the router's health check takes the prefill
    server out, and when it routes again after the restart, with the
    single-engine answer; the timings are returned (and printed, for docs/serving.md)."""
    import openai

    ref = references(reference, [prompt])
    seen, before = total(decode.metrics(), "vllm:prompt_tokens_total"), kvtail(decode)
    t0 = time.monotonic()
    first = send(openai_client(router.url), prompt, MAX_TOKENS)
    err = first.error
    assert isinstance(err, openai.APIStatusError) and err.status_code in (500, 503), repr(err)
    wait_until(router.prefill_down, 60, f"router {router.name}: prefill server down")
    down_s = time.monotonic() - t0
    later = send(openai_client(router.url), prompt, MAX_TOKENS).error
    assert isinstance(later, openai.APIStatusError) and later.status_code == 503, repr(later)
    assert total(decode.metrics(), "vllm:prompt_tokens_total") == seen
    assert mismatches([send(openai_client(decode.url), prompt, MAX_TOKENS)], ref) == []
    wait_counts(decode, before, {"failed_loads": 0, "held_requests": 0})
    prefill.start().wait_ready()
    t1 = time.monotonic()
    router.wait_ready()
    up_s = time.monotonic() - t1
    assert mismatches([send(openai_client(router.url), prompt, MAX_TOKENS)], ref) == []
    seen_by_client = {"status": err.status_code, "body": str(err.body)[:160]}
    timings = {"first": seen_by_client, "marked_down_s": down_s, "routes_again_s": up_s}
    print(f"\nrouter {router.name} with its prefill server dead: {timings}")
    return timings
