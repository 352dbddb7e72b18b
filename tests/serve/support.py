"""Helpers of the serving tests: polling, metrics, references, comparisons."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtail_connector.demo import procs
from kvtail_connector.demo.api_server import APIServer
from kvtail_connector.demo.prom_text import delta, info_label, kvtail_values, total
from kvtail_connector.demo.workload import Answer, Prompt, openai_client, send_all

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
