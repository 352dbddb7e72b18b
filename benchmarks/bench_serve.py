"""Serving cost of KVTailConnector: the plain and the wrapped P/D pair, interleaved.

Streamed, greedy completion requests of random prompt lengths go through
``vllm-router`` (one per pair, ``--vllm-pd-disaggregation``) to each pair in turn,
round after round (the order alternates), so that both see the same machine load. Per
pair: requests/s, decode tokens/s, time to first token and inter-token latency
percentiles; then the ratios wrapped/plain (throughput goal >= 0.99).

CPU (starts a plain and a wrapped NIXL pair of tiny-model API servers itself):

    .venv/bin/python benchmarks/bench_serve.py --rounds 6 --requests 48

GPU (servers you started; the routers are started here, on loopback, unless given):

    python benchmarks/bench_serve.py --model MODEL \
        --prefill-url plain=http://h:8100 --decode-url plain=http://h:8200 \
        --prefill-url wrapped=http://h:8300 --decode-url wrapped=http://h:8400 \
        [--router-url plain=http://h:8000 --router-url wrapped=http://h:8001]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.router import Router  # noqa: E402
from demo.workload import (  # noqa: E402
    Answer,
    completion_prompt,
    openai_client,
    send,
)

VARIANTS = ("plain", "wrapped")


def _labelled(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        label, sep, url = v.partition("=")
        if not sep or label not in VARIANTS:
            raise SystemExit(f"{flag} wants plain=URL or wrapped=URL, got {v!r}")
        out[label] = url.rstrip("/")
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def run_batch(url: str, model: str, n: int, conc: int, max_tokens: int, seed: int) -> tuple:
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    prompts = [completion_prompt(rng.randrange(16, 400), rng, True) for _ in range(n)]
    client = openai_client(url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(conc) as pool:
        answers = list(pool.map(lambda p: send(client, p, max_tokens, model=model), prompts))
    return answers, time.monotonic() - t0


def summarize(answers: list[Answer], wall: float) -> dict[str, Any]:
    ok = [a for a in answers if a.error is None]
    ttft = [a.ttft for a in ok if a.ttft is not None]
    itl = [x for a in ok for x in a.itls]
    tokens = sum(len(a.token_ids) for a in ok)
    return {
        "requests": len(answers),
        "errors": len(answers) - len(ok),
        "wall_s": round(wall, 3),
        "requests_per_s": len(ok) / wall,
        "decode_tokens_per_s": tokens / wall,
        **{f"ttft_p{q}_ms": 1000 * percentile(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": 1000 * percentile(itl, q) for q in (50, 90, 99)},
    }


def start_cpu_pairs(
    stack: ExitStack, log_dir: Path, zero_tails: str, control: bool, vouch_tails: str = "auto"
) -> dict[str, tuple[str, str]]:
    """A plain and a wrapped NIXL pair of tiny-Llama servers (probe off). With
    ``control`` the "wrapped" pair is plain too: the ratio then shows the noise."""
    from demo.serving import Fleet
    from demo.tiny_model import ensure_tiny_llama

    model = str(ensure_tiny_llama())
    fleet = Fleet(log_dir)
    stack.callback(fleet.close)
    for v in VARIANTS:
        fleet.add_pair(
            v,
            model,
            wrapped=v == "wrapped" and not control,
            zero_tails=zero_tails,
            probe=False,
            spec={"max_num_seqs": 32},
            options={"vouch_tails": vouch_tails},
        )
    print(f"starting 4 API servers (logs in {log_dir}) ...", flush=True)
    fleet.start()
    return {v: (p.prefill.url, p.decode.url) for v, p in fleet.pairs.items()}


def paired_ratio(plain: list[float], wrapped: list[float]) -> dict[str, float]:
    """Median over rounds of wrapped/plain throughput (plain wall / wrapped
    wall, the same requests), with a 95 % bootstrap interval of that median."""
    r = np.asarray(plain) / np.asarray(wrapped)
    rng = np.random.default_rng(0)
    boots = np.median(rng.choice(r, (5000, r.size)), axis=1)
    return {
        "median": float(np.median(r)),
        "low": float(np.percentile(boots, 2.5)),
        "high": float(np.percentile(boots, 97.5)),
        "rounds": int(r.size),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill-url", action="append", default=[], help="LABEL=URL (plain, wrapped)")
    ap.add_argument("--decode-url", action="append", default=[], help="LABEL=URL")
    ap.add_argument(
        "--router-url", action="append", default=[], help="LABEL=URL of your vllm-router"
    )
    ap.add_argument("--model", default="model", help="served model name (default: model)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds; each runs both pairs")
    ap.add_argument("--requests", type=int, default=48, help="requests per pair and round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument(
        "--zero-tails",
        choices=["always", "auto", "off"],
        default="always",
        help="the CPU wrapped pair's zero_tails (the tiny Llama needs always to zero)",
    )
    ap.add_argument(
        "--vouch-tails",
        choices=["auto", "trust", "off"],
        default="auto",
        help="the CPU wrapped pair's vouch_tails (trust: the producer zeroes and vouches; "
        "auto: over NIXL it does not, the consumer zeroes anyway)",
    )
    ap.add_argument(
        "--control", action="store_true", help="CPU: both pairs plain (an A/A run: the noise)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with ExitStack() as stack:
        routers = _labelled(args.router_url, "--router-url")
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvtail-bench-serve-"))
        if not routers:
            pre = _labelled(args.prefill_url, "--prefill-url")
            dec = _labelled(args.decode_url, "--decode-url")
            if pre or dec:
                if set(pre) != set(VARIANTS) or set(dec) != set(VARIANTS):
                    raise SystemExit("give --prefill-url and --decode-url for plain and wrapped")
                pairs = {v: (pre[v], dec[v]) for v in VARIANTS}
            else:
                pairs = start_cpu_pairs(
                    stack, log_dir, args.zero_tails, args.control, args.vouch_tails
                )
            for v in VARIANTS:
                p, d = pairs[v]
                routers[v] = stack.enter_context(Router(v, [p], [d], log_dir)).url
        elif set(routers) != set(VARIANTS):
            raise SystemExit("give --router-url for plain and wrapped")

        common = (args.model, args.requests, args.concurrency, args.max_tokens)
        for v in VARIANTS:  # warm-up, not measured
            run_batch(routers[v], args.model, args.concurrency, args.concurrency, 4, seed=99)
        collected: dict[str, list[Answer]] = {v: [] for v in VARIANTS}
        walls: dict[str, float] = dict.fromkeys(VARIANTS, 0.0)
        round_walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                answers, wall = run_batch(routers[v], *common, seed=r)  # same prompts for both
                collected[v] += answers
                walls[v] += wall
                round_walls[v].append(wall)
                print(f"round {r + 1}/{args.rounds} {v:8s} {wall:6.1f} s", flush=True)

    results = {v: summarize(collected[v], walls[v]) for v in VARIANTS}
    p, w = results["plain"], results["wrapped"]
    ratios = {
        "requests_per_s": w["requests_per_s"] / p["requests_per_s"],
        "decode_tokens_per_s": w["decode_tokens_per_s"] / p["decode_tokens_per_s"],
        "ttft_p50": w["ttft_p50_ms"] / p["ttft_p50_ms"],
        "itl_p50": w["itl_p50_ms"] / p["itl_p50_ms"],
    }
    # Each round runs the same requests through both pairs back to back: the
    # median of per-round ratios is less moved by the machine's drift.
    paired = paired_ratio(round_walls["plain"], round_walls["wrapped"])
    keys = [k for k in p if k not in ("requests", "wall_s")]
    print(f"\n{'':22s} {'plain':>10s} {'wrapped':>10s}")
    for k in keys:
        print(f"{k:22s} {p[k]:10.2f} {w[k]:10.2f}")
    print(
        "\nwrapped/plain: requests/s {requests_per_s:.3f}, decode tokens/s "
        "{decode_tokens_per_s:.3f}, TTFT p50 {ttft_p50:.3f}, ITL p50 {itl_p50:.3f}".format(**ratios)
    )
    print(
        "wrapped/plain requests/s per round (paired): median {median:.3f} "
        "[{low:.3f}, {high:.3f}] (95 % bootstrap, {rounds} rounds)".format(**paired)
    )
    keys_set = (
        "rounds",
        "requests",
        "concurrency",
        "max_tokens",
        "zero_tails",
        "vouch_tails",
        "control",
    )
    settings = {k: getattr(args, k) for k in keys_set}
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": settings, "results": results, "ratios": ratios, "paired": paired},
                indent=2,
            )
        )
    errors = p["errors"] + w["errors"]
    if errors:
        print(f"{errors} request(s) failed", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
