"""``python -m demo``: the stale-tail bug between two vLLM CPU engines,
then the same requests through ``KVTailConnector``. By default a tiny Mamba hybrid
over NIXL with the wrapper's default ``zero_tails: "auto"``.

Exit status 0 when every request through the wrapper left no NaN in the decode
engine's blocks and decoded exactly like a single engine; 1 otherwise; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from demo import procs
from demo.report import render
from demo.scenarios import run, scenario


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not values or any(not 1 <= v <= 200 for v in values):
        raise argparse.ArgumentTypeError("prompt lengths must be between 1 and 200")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m demo",
        description="P/D on two vLLM CPU engines: plain connector vs KVTailConnector.",
    )
    ap.add_argument(
        "--backend",
        choices=["nixl", "mooncake"],
        default="nixl",
        help="nixl (default): NixlConnector over UCX; mooncake: MooncakeStoreConnector "
        "with a local mooncake_master",
    )
    ap.add_argument(
        "--model",
        choices=["hybrid", "llama"],
        default=None,
        help="hybrid: a tiny Mamba/attention hybrid (Granite over NIXL, Qwen3-Next over "
        "MooncakeStore); llama: a tiny uniform Llama (default: hybrid over NIXL, llama "
        "over MooncakeStore)",
    )
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="MooncakeStore with a tiny Qwen3-Next hybrid, where store hits end mid-block "
        "(the same as --backend mooncake --model hybrid); it does not show the bug: "
        "MooncakeStore copies whole pages, so the plain rows are right too "
        "(docs/development.md, the demo)",
    )
    ap.add_argument(
        "--lengths",
        type=_lengths,
        default=[45, 77, 100],
        help="prompt lengths, comma-separated (default 45,77,100: none block-aligned)",
    )
    ap.add_argument(
        "--zero-tails",
        choices=["auto", "always", "off"],
        default=None,
        help="the wrapper's zero_tails (default: auto on the hybrids, always on the uniform "
        "Llama); auto or off on the Llama shows the demo failing",
    )
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens to decode (default 8)")
    ap.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: temp dir)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temp log dir")
    return ap.parse_args(argv)


def scenario_name(args: argparse.Namespace) -> str:
    """The scenario the flags ask for (see ``scenarios.scenario``)."""
    if args.hybrid:
        return "hybrid"
    model = args.model or ("hybrid" if args.backend == "nixl" else "llama")
    if args.backend == "nixl":
        return "hybrid_nixl" if model == "hybrid" else "nixl"
    return "hybrid" if model == "hybrid" else "mooncake"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    name = scenario_name(args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvtail-demo-"))
    t0 = time.monotonic()
    ok = False
    try:
        sc = scenario(name)
        if args.zero_tails is not None and args.zero_tails != sc.zero_tails:
            sc.zero_tails = args.zero_tails
            sc.notes = [n for n in sc.notes if "zero_tails" not in n]
            sc.notes.append(f'zero_tails="{args.zero_tails}" (from --zero-tails)')
        outcome = run(sc, args.lengths, args.max_tokens, log_dir)
        print()
        print(render(outcome))
        failures = outcome.failures()
        print()
        if failures:
            print("FAIL: the wrapper did not protect every request:")
            for f in failures:
                print(f"  - {f}")
        else:
            print(
                "OK: through KVTailConnector every request decoded exactly like a single "
                "engine, with no NaN left."
            )
        ok = not failures
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the engines", file=sys.stderr)
        return 130
    finally:
        procs.close_all()
        keep = args.keep_logs or args.log_dir is not None or not ok
        if keep:
            print(f"engine logs: {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
        print(f"total {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
