"""Where the scheduler side's per-load time goes, by elimination (CPU).

    .venv/bin/python benchmarks/alloc_variants.py [--rounds 2] [--steps 300]
        [--hook-steps 400] [--json out.json]

Runs ``bench_host.py``'s scheduler bench (16 async loads completing per step
beside 256 decoding requests, the wrapper against the bare double,
interleaved) once per variant of the wrapper's allocation hook
(``TailScheduler.update_state_after_alloc``), each in its own process, the
variants alternating round by round so that the machine's drift hits all
alike. Three of them do less than the product does: they are lower bounds
of what a hook doing that much can cost, not designs.

- ``head``: the code as it is.
- ``bookkeeping``: the hook pops the load's match, takes the group ids vLLM
  was just given and marks the load in flight; it reads no block id and
  keeps nothing to build a record from (no tail is zeroed).
- ``no_ids``: as ``head``, but every group's written ids are an empty
  tuple: what reading the ids from vLLM's block objects costs.
- ``record_at_alloc``: the record built in the hook, as before the step's
  one pass at the metadata (nothing is left for that pass).

Printed per variant (medians over rounds): the paired step ratio, the time
the hooks add per step, and the two hooks the variants move work between.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("head", "bookkeeping", "no_ids", "record_at_alloc")
ALLOC = "update_state_after_alloc (n>0)"
META = "build_connector_meta"


def _patch(variant: str) -> None:
    """Replace the allocation hook of ``TailScheduler`` for this process."""
    from kvtail_connector.scheduler import TailScheduler

    if variant == "head":
        return
    head = TailScheduler.update_state_after_alloc

    if variant == "no_ids":

        def no_ids(self: Any, request: Any, blocks: Any, n: int) -> None:
            records = self._records
            records.written = lambda _b, groups, _l, _n: ((),) * len(groups)
            try:
                head(self, request, blocks, n)
            finally:
                del records.written

        TailScheduler.update_state_after_alloc = no_ids  # type: ignore[method-assign]
        return

    def reduced(self: Any, request: Any, blocks: Any, n: int) -> None:
        req_id = request.request_id
        start = self._matched.pop(req_id, None)
        if self._readings:
            self._readings.pop(req_id, None)
        if start is None or n <= 0 or not start[1]:
            return
        asked = self.asked_loaded
        if asked is not None and asked[0] is request:
            groups = asked[1]
            self.asked_loaded = None
        else:
            groups = self._records.loaded_groups(request)
        local = start[0]
        if variant == "bookkeeping":
            self._errors.in_flight_by_request[req_id] = ()
            return
        records = self._records
        written = records.written(blocks, groups, local, local + n)
        self._errors.in_flight_by_request[req_id] = written
        record = records.from_written(req_id, written, local, local + n, groups)
        if record is not None:
            self._tails.records.append(record)

    TailScheduler.update_state_after_alloc = reduced  # type: ignore[method-assign]


def _one(variant: str, steps: int, hook_steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_host

    bench_host._setup_path()
    _patch(variant)
    # The per-length part calls the hook directly and checks its records.
    bench_host._bench_load_length = lambda *_: {}
    r = bench_host.bench_scheduler(steps, hook_steps)["b_loads_completing"]
    hooks = r["per_hook"]
    return {
        "paired_ratio": r["sched_paired_ratio"],
        "hooks_added_us": r["hooks_paired_diff_median_us"],
        "alloc_added_us": hooks[ALLOC]["paired_diff_us"],
        "meta_added_us": hooks[META]["paired_diff_us"],
        "bare_step_us": r["sched_bare"]["median_us"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hook-steps", type=int, default=400)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args.steps, args.hook_steps)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for v in order:
            cmd = [sys.executable, __file__, "--one", v, "--steps", str(args.steps)]
            cmd += ["--hook-steps", str(args.hook_steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1} {v}: {runs[v][-1]}", flush=True)
    print(
        "\n| variant | runs | paired step ratio | hooks added µs/step | alloc (n>0) added "
        "| metadata added | bare step µs |"
    )
    print("|---|---|---|---|---|---|---|")
    for v, rs in runs.items():

        def col(key: str, fmt: str, rs: list[dict[str, Any]] = rs) -> str:
            return " / ".join(format(r[key], fmt) for r in rs)

        print(
            f"| {v} | {len(rs)} | {col('paired_ratio', '.3f')} | {col('hooks_added_us', '.0f')} "
            f"| {col('alloc_added_us', '.0f')} | {col('meta_added_us', '.0f')} "
            f"| {col('bare_step_us', '.0f')} |"
        )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
