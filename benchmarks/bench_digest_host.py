"""Host cost of ``verify_kv: digest`` per request, without the launch, on CPU.

What the worker's Python does for a request's digest, by prompt length: P's
bind (the plan: block ids as an array, the range), P's hook (the launch's
work buffer), D's bind (the plan, the producer's sums as arrays), D's
completion (the work buffer) and its comparison once the sums are on the
host. The kernel launch and the device copies are left out (a no-op launch;
on a GPU they are a fixed cost per step, see ``bench_worker_gpu.py``).

    PYTHONPATH=. python3 benchmarks/bench_digest_host.py [--json out.json]

Caches: 2 layers x 8 KV heads, 16-token blocks (the rows' count does not
enter the host's work). Requests: 1 or 16 per step, of 1k, 8k and 128k
tokens, on shuffled blocks. Medians of ``--reps`` (µs per step and per
request).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets a CPU digester take the kernel path

import numpy as np
import torch
from without_vllm import install_if_absent

install_if_absent()

from kvtail_connector.core.cache_sets import CacheSet  # noqa: E402
from kvtail_connector.core.metadata import GroupLoad  # noqa: E402
from kvtail_connector.extras.entry_values import Digest, segment_for  # noqa: E402
from kvtail_connector.extras.kv_verification import rank_digests  # noqa: E402
from kvtail_connector.extras.metadata import VERIFIED, CheckedLoad, ExpectedDigest  # noqa: E402
from kvtail_connector.extras.ops.digest.launcher import KVDigester  # noqa: E402
from kvtail_connector.extras.ops.digest.results import GroupDigest  # noqa: E402

BLOCK = 16
SIZES = [(1, 1024), (1, 8192), (1, 131072), (16, 1024), (16, 8192)]


class _NoLaunch(KVDigester):
    """The kernel path with the launch left out (and so, no sums)."""

    def __init__(self, groups, **kw):
        super().__init__(groups, implementation="triton", **kw)

    def _launch(self, work, units):
        return None


def timed(fn, reps, before=None) -> float:
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=51)
    ap.add_argument("--json")
    args = ap.parse_args()
    rank_digests.KVDigester = _NoLaunch  # type: ignore[misc]
    num_blocks = max(n * k // BLOCK for k, n in SIZES) + 16
    caches = [torch.zeros(num_blocks, 8, BLOCK, 8, dtype=torch.bfloat16) for _ in range(2)]
    digests = rank_digests.RankDigests([CacheSet(0, 1, 1, caches)])
    rng = np.random.default_rng(0)
    rows = []
    print(
        "| requests | tokens each | P bind | P hook | D bind | D completion | D compare | "
        "P per request | D per request |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, n in SIZES:
        per = -(-n // BLOCK)
        perm = rng.permutation(num_blocks)
        records = [
            CheckedLoad(
                f"r{i}",
                0,
                n,
                (GroupLoad(0, 0, tuple(int(b) for b in perm[i * per : (i + 1) * per])),),
            )
            for i in range(k)
        ]
        segment = segment_for(n)
        n_seg = -(-n // segment)
        sums = {0: {h: tuple(int(v) for v in rng.integers(0, 2**63, n_seg)) for h in range(8)}}
        dg = Digest(rank_digests.ALGORITHM, segment, digests.signature, sums)
        loads = [
            CheckedLoad(r.req_id, 0, n, r.groups, expected=ExpectedDigest(n, dg)) for r in records
        ]
        planned: list = []

        def p_bind(records=records, planned=planned):
            planned[:] = digests.plan_prompts(records)

        p_bind()
        p_bind_us = timed(p_bind, args.reps)
        p_hook_us = timed(lambda planned=planned: digests.digest_prompts(planned), args.reps)

        d_bind_us = timed(lambda loads=loads: digests.plan_loads(loads), args.reps)

        def d_complete(loads=loads):
            digests.check_loads(loads)

        def rebind(loads=loads):
            digests._checks._held.clear()
            digests.take_verdicts()
            digests.plan_loads(loads)

        d_complete_us = timed(d_complete, args.reps, before=rebind)
        # The comparison, the producer's sums and ours equal (as a clean load's).
        rebind()
        d_complete()
        theirs = [np.array([sums[0][h] for h in range(8)], dtype=np.uint64)]
        for check in digests._checks._held.values():
            check.result = lambda theirs=theirs: [GroupDigest(tuple(range(8)), theirs[0])]
        checks = list(digests._checks._held.values())
        assert all(digests._compare(c).verdict == VERIFIED for c in checks)

        def compare(checks=checks):
            for c in checks:
                digests._compare(c)

        d_compare_us = timed(compare, args.reps)
        p_req = (p_bind_us + p_hook_us) / k
        d_req = (d_bind_us + d_complete_us + d_compare_us) / k
        rows.append(
            dict(
                requests=k,
                tokens=n,
                p_bind_us=p_bind_us,
                p_hook_us=p_hook_us,
                d_bind_us=d_bind_us,
                d_complete_us=d_complete_us,
                d_compare_us=d_compare_us,
                p_per_request_us=p_req,
                d_per_request_us=d_req,
            )
        )
        print(
            f"| {k} | {n} | {p_bind_us:.1f} | {p_hook_us:.1f} | {d_bind_us:.1f} | "
            f"{d_complete_us:.1f} | {d_compare_us:.1f} | {p_req:.1f} | {d_req:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
