"""Differential run: two versions of kvtail_connector over the same random hook sequences.

``scripts/differential BASE_REV`` exports BASE_REV's package and runs this with
``--base-root`` (the export) and ``--new-root`` (the working tree): each root is
driven in its own process (both packages are named kvtail_connector), first on
PYTHONPATH, the working tree's ``tests/`` after it; the JSON-lines traces are
compared. Exit 0: identical; 1: the first difference (seed, config, step, hook,
field); 2: a run failed.

Only what every version keeps is touched: the facade as vLLM builds and calls it
(a real Scheduler; a worker in the model runner's order with a forward writing
each layer's KV), the wire ``kvtail`` entry, stats payloads, Prometheus values.
Per seed, each of the 54 policies runs on a consumer D beside a producer P (with
a permuted policy), over an async NIXL-like and a sync MoRIIO-READ-like inner
double (tests/helpers/landing_doubles.py), on a plain, a hybrid (Mamba) and a
mixed-precision model. Requests arrive; P's finished remote-decode requests reach
D with P's params (sometimes bent) and P's bytes; loads complete, fail, report
invalid blocks, are aborted or preempted. After each step the trace holds every
hook's answer to vLLM (build_connector_meta's inner part, transfer results,
request_finished's params...), vLLM's zero list, request states, the stats
payload, Prometheus values and a hash of each worker's KV bytes. Deterministic:
seeded, PYTHONHASHSEED=0, no times or ids; the package version reads "<version>".
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ZERO, VOUCH, VERIFY = ("auto", "always", "off"), ("auto", "trust", "off"), ("off", "digest", "auto")
POLICIES = list(itertools.product(ZERO, VOUCH, VERIFY, (False, True)))  # + probe_stale_tails
SETUPS = [(i, m) for i in ("async", "read") for m in ("plain", "hybrid", "mixed")]
HOSTILE = ["digest", "tail", "other", "unbound", "version", "junk", "deep", "wide", "mac"]
BINDING_KEYS = ("remote_engine_id", "remote_request_id", "transfer_id", "remote_block_ids")
KEY_ENV = "KVTAIL_DIFFERENTIAL_KEY"  # the shared entry key, on odd seeds
INJECT_ENV = "KVTAIL_DIFFERENTIAL_INJECT"  # "SEED:STEP": the new run alone flips a KV byte


def hostile(rng: random.Random, params: dict[str, Any]) -> str:
    """Mostly nothing; else one way a client, a router or a bug bends the params."""
    entry = params["kvtail"] if isinstance(params.get("kvtail"), dict) else {}
    how = rng.choice(["none"] * 8 + HOSTILE)
    if how == "digest" and isinstance(entry.get("dg"), dict):  # a sum one hex digit off
        text = json.dumps(entry["dg"].get("g"))
        if found := re.search(r'"[0-9a-f]{15}([0-9a-f])"', text):
            at = found.start(1)
            entry["dg"]["g"] = json.loads(text[:at] + "10"[found[1] == "1"] + text[at + 1 :])
    elif how == "tail" and entry:
        entry["tail"] = "zero"  # a claim P never made
    elif how in ("other", "unbound"):
        params["remote_request_id"] = "another-request" if how == "other" else None
    elif how == "version" and entry:
        entry["v"] = rng.choice([1, 3, 99, "2", None])
    elif how == "junk":
        params["kvtail"] = rng.choice(["zero", 7, None, [1, 2], {"v": 2, "n": "x"}, {}])
    elif how == "deep":
        deep: dict[str, Any] = {"v": 2}
        params["kvtail"] = deep
        for _ in range(300):
            deep["dg"] = deep = {"v": 2, "tail": "zero"}
    elif how == "wide":
        params["kvtail"] = {
            "v": 2,
            "tail": "zero",
            "dg": {"g": list(range(20000))},
            "pv": "9" * 9999,
        }
    elif how == "mac" and entry:
        entry["mac"] = "0" * 64
    return how


def load_params(rng: random.Random, prompt: int, whole: bool, model: str, inner: str) -> dict:
    """The double's keys for a load of (all or part of) a ``prompt``-token prompt.
    vLLM takes invalid blocks from single-group models only (a failed READ reports them)."""
    tokens = prompt if whole and rng.random() < 0.8 else rng.randint(1, prompt)
    blocks = model == "plain"
    params: dict[str, Any] = {"double_load_tokens": tokens}
    params["double_finish_after_steps"] = rng.randint(1, 3)
    params["double_fail"] = rng.random() < 0.12 and (blocks or inner == "async")
    if blocks and rng.random() < 0.12:
        params["double_invalid_block_indices"] = [rng.randrange(-(-tokens // 16))]  # 16/block
        params["double_invalid_late"] = rng.random() < 0.3
    return params


def run(seed: int, index: int, setup: tuple[str, str], steps: int, inject: str | None) -> Any:
    """The trace records of one configuration under ``seed``: D runs policy
    ``index``, P another (a permutation: every policy is P's once too)."""
    from vllm.v1.request import RequestStatus

    from tests.helpers import landing_doubles as doubles
    from tests.helpers.recorded_engine import Engine, scrub
    from tests.helpers.vllm_factories import refusal_text

    (inner, model), d_policy = setup, POLICIES[index]
    p_policy = POLICIES[(5 * index + 1) % len(POLICIES)]
    sides = (("D", d_policy), ("P", p_policy))
    name = " ".join(
        f"{s} zero={z} vouch={v} verify={k} probe={int(b)} |" for s, (z, v, k, b) in sides
    )
    head = {"seed": seed, "config": f"{name} inner={inner} model={model}"}

    def build(role: str, policy: tuple) -> Engine:
        names = ("zero_tails", "vouch_tails", "verify_kv", "probe_stale_tails")
        extra = dict(zip(names, policy, strict=True))
        extra.update(backend={"async": "LandingLoadDouble", "read": "ReadLoadDouble"}[inner])
        extra.update(backend_module_path=doubles.MODULE_PATH)
        if seed % 2:
            extra.update(entry_key_env=KEY_ENV)
        return Engine(role, extra, model, "fail" if seed % 2 else "recompute")

    try:
        p, d = build("kv_producer", p_policy), build("kv_consumer", d_policy)
    except Exception as exc:
        yield {**head, "step": 0, "refused": scrub(refusal_text(exc))}
        return
    rng = random.Random(f"{seed}/{head['config']}")  # a str seed: PYTHONHASHSEED plays no part
    routed: list[tuple[int, str, int, dict[str, Any]]] = []
    prompts: dict[str, int] = {}  # P's requests' prompt lengths
    doubles.SOURCES.clear()
    for step in range(steps):
        actions: list[str] = []
        arrivals = step < steps * 3 // 4  # then what is in flight drains
        try:
            if arrivals and rng.random() < 0.7:
                remote, req_id = rng.random() < 0.8, f"P{seed}-{step}"
                prompts[req_id] = prompt = rng.randint(1, 200)
                params = {"do_remote_decode": True} if remote else {}
                actions.append(p.add(req_id, prompt, params, 1 if remote else 3))
            if arrivals and rng.random() < 0.35:  # a load no producer made
                prompt = rng.randint(1, 200)
                params = load_params(rng, prompt, False, model, inner)
                if rng.random() < 0.2:
                    actions.append(f"hostile: {hostile(rng, params)}")
                actions.append(d.add(f"L{seed}-{step}", prompt, params, rng.randint(1, 4)))
            for due, req_id, prompt, params in [r for r in routed if r[0] <= step]:
                routed.remove((due, req_id, prompt, params))
                actions.append(d.add(req_id, prompt, params, rng.randint(1, 4)))
            engine = rng.choice([p, d])
            if rng.random() < 0.1 and engine.scheduler.requests:
                victim = rng.choice(sorted(engine.scheduler.requests))
                engine.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
                actions.append(f"abort {victim}")
            engine = rng.choice([p, d])
            waits = RequestStatus.WAITING_FOR_REMOTE_KVS  # their blocks stay: vLLM's reset fails
            if rng.random() < 0.04 and waits not in {r.status for r in engine.requests()}:
                engine.scheduler.reset_prefix_cache(reset_running_requests=True)
                actions.append("preempt " + ("P" if engine is p else "D"))
            record: dict[str, Any] = {
                **head,
                "step": step,
                "actions": actions,
                "P": p.step(),
                "D": d.step(),
            }
        except Exception as exc:
            yield {**head, "step": step, "actions": actions, "raised": scrub(exc)}
            return
        if inject == f"{seed}:{step}" and index == 0:  # the self-check
            d.caches.raw[0][7] += 1
            record["D"]["kv"] = d.kv_hash()
        for req_id, params in sorted(p.finished_params.items()):
            if params and "remote_block_ids" in params:  # to D, with P's bytes
                d_id = "D" + req_id[1:]
                doubles.SOURCES[d_id] = p.pages(params["remote_block_ids"])
                sent = {
                    k: copy.deepcopy(params[k]) for k in (*BINDING_KEYS, "kvtail") if k in params
                }
                sent.update(load_params(rng, prompts[req_id], True, model, inner))
                how = hostile(rng, sent)
                routed.append((step + rng.randint(0, 2), d_id, prompts[req_id], sent))
                record["actions"].append(f"route {req_id} -> {d_id} (hostile: {how})")
        yield record


def drive(args: argparse.Namespace) -> None:
    """In this process: check which package runs, then write the trace."""
    import torch

    import kvtail_connector
    import tests
    from tests.helpers import recorded_engine

    for module, root in ((kvtail_connector, args.package_root), (tests, REPO)):
        where = Path(str(module.__file__)).resolve().parent.parent
        assert where == Path(str(root)).resolve(), (
            f"{module.__name__} from {where}, expected {root}"
        )
    torch.set_num_threads(1)
    recorded_engine.set_version(kvtail_connector.__version__)
    os.environ[KEY_ENV] = "differential-key"
    inject = os.environ.get(INJECT_ENV)
    with open(args.drive, "w") as out:
        for seed, index, setup in itertools.product(
            range(args.seeds), range(len(POLICIES)), SETUPS
        ):
            for record in run(seed, index, setup, args.steps, inject):
                out.write(json.dumps(record, sort_keys=True) + "\n")


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    if type(a) is not type(b) or not isinstance(a, (dict, list)):
        return None if a == b else (path, a, b)
    if isinstance(a, dict):
        items = [(f"{path}.{k}", a.get(k, "<none>"), b.get(k, "<none>")) for k in sorted({*a, *b})]
    else:
        pairs = itertools.zip_longest(a, b, fillvalue="<none>")
        items = [(f"{path}[{i}]", va, vb) for i, (va, vb) in enumerate(pairs)]
    return next((found for at, va, vb in items if (found := first_difference(va, vb, at))), None)


def compare(base: Path, new: Path, args: argparse.Namespace) -> int:
    refused = 0
    with base.open() as fa, new.open() as fb:
        for la, lb in itertools.zip_longest(fa, fb):
            if la == lb:
                refused += '"refused"' in la
                continue
            if la is None or lb is None:
                print("difference: one trace is longer (every record before is identical)")
                return 1
            ra, rb = json.loads(la), json.loads(lb)
            path, va, vb = first_difference(ra, rb) or ("", la, lb)
            at = re.match(r"\.([PD])\.hooks\[(\d+)\]", path)
            hook = ra[at[1]]["hooks"][int(at[2])].get("hook") if at else "-"
            print(
                f"difference: seed {ra['seed']}, step {ra.get('step')}, hook {hook}, "
                f"field {path.lstrip('.')}\n  config: {ra['config']}\n"
                f"  base: {json.dumps(va)[:400]}\n  new:  {json.dumps(vb)[:400]}"
            )
            return 1
    print(
        f"identical: {args.seeds} seeds × {args.steps} steps × {len(POLICIES)} policies "
        f"(each on D and on P, {len(SETUPS)} inner/model setups; "
        f"{refused} refused at start-up by both)"
    )
    return 0


def orchestrate(args: argparse.Namespace) -> int:
    """Both drives at once, each in its own process and package; then compare."""
    tmp = Path(tempfile.mkdtemp(prefix="kvtail-differential-"))
    procs = {}
    for side, root in (("base", args.base_root), ("new", args.new_root)):
        env = dict(
            os.environ,
            PYTHONHASHSEED="0",
            HF_HUB_OFFLINE="1",
            VLLM_TARGET_DEVICE="cpu",
            TRITON_INTERPRET="1",
            OMP_NUM_THREADS="1",
            PYTHONDONTWRITEBYTECODE="1",
            VLLM_LOGGING_LEVEL="ERROR",
        )
        roots = [args.vllm] if args.vllm else []
        roots += [str(Path(root).resolve()), str(REPO)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots))
        if side == "base":
            env.pop(INJECT_ENV, None)
        cmd = [
            sys.executable,
            __file__,
            "--drive",
            str(tmp / f"{side}.jsonl"),
            "--package-root",
            str(root),
            "--seeds",
            str(args.seeds),
            "--steps",
            str(args.steps),
        ]
        with (tmp / f"{side}.log").open("w") as log:
            procs[side] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    failed = [side for side, proc in procs.items() if proc.wait() != 0]
    for side in failed:
        tail = (tmp / f"{side}.log").read_text().splitlines()[-30:]
        print(f"the {side} run failed ({tmp / side}.log):\n" + "\n".join(tail))
    code = 2 if failed else compare(tmp / "base.jsonl", tmp / "new.jsonl", args)
    if code:
        print(f"traces and logs: {tmp}")
    else:
        shutil.rmtree(tmp)
    return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-root", help="a folder holding the base kvtail_connector")
    ap.add_argument("--new-root", default=str(REPO), help="the same for the new one")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--vllm", type=os.path.abspath, help="a vLLM overlay put first (.vllm033)")
    ap.add_argument("--drive", help=argparse.SUPPRESS)  # internal: write this trace there
    ap.add_argument("--package-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        drive(args)
        return 0
    if not args.base_root:
        ap.error("--base-root is required (scripts/differential BASE_REV sets it)")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
