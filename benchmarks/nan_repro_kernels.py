"""The stale-tail NaN through the attention kernels users run: PyTorch SDPA and FlexAttention.

``nan_repro.py`` proves the bug with the project's own paged decode. This runs
the same stale pages (same seeded pools, same requests, same zeroing through
``zero_kv_blocks``) through PyTorch's kernels, masked the way vLLM's backends
mask them, on the WHOLE pages of each request's block table:

- ``sdpa-math``, ``sdpa-efficient``, ``sdpa-cudnn``:
  ``scaled_dot_product_attention`` with a boolean ``attn_mask`` of the valid
  slots, each under ``sdpa_kernel(...)`` pinned to that backend (GQA through
  ``enable_gqa``);
- ``flex``: ``flex_attention`` with a ``BlockMask`` from
  ``mask_mod = kv_idx < valid`` over the gathered pages, what vLLM's
  FLEX_ATTENTION backend builds for paged KV (compiled on CUDA).

A masked score is dropped (``-inf``) before the softmax, but its probability
then multiplies the masked slot's V: ``0 * NaN = NaN``. Per case and kernel:
NaN outputs before zeroing, NaN after, and whether the output after zeroing is
bit-identical to the same kernel on the clean pool. Non-DCP cases only (these
kernels return no log-sum-exp to merge DCP ranks with).

    PYTHONPATH=. python3 benchmarks/nan_repro_kernels.py [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nan_repro  # noqa: E402

from kvtail_connector import zero_kv_blocks  # noqa: E402

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _split(kv: torch.Tensor, case: nan_repro.Case, sizes: nan_repro.Sizes):
    if case.mla:
        return kv, kv[..., : sizes.mla_v]
    return kv[..., : sizes.head_dim], kv[..., sizes.head_dim :]


def sdpa(backend: object, dtype: torch.dtype) -> Kernel:
    """SDPA pinned to ``backend``: q ``[Hq, D]``, k/v ``[H, T, D]``, mask ``[T]``."""
    from torch.nn.attention import sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
        # GQA as attention backends feed SDPA: each KV head repeated for its
        # query heads (the memory-efficient kernel takes no enable_gqa).
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        with sdpa_kernel([backend]):  # type: ignore[list-item]
            out = F.scaled_dot_product_attention(
                q.to(dtype)[None, :, None, :],
                k.to(dtype)[None],
                v.to(dtype)[None],
                attn_mask=mask[None, None, None, :],
                scale=1.0 / math.sqrt(k.shape[-1]),
            )
        return out[0, :, 0, :].float()

    return run


def flex(dtype: torch.dtype, compiled: bool) -> Kernel:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
        valid = int(mask.sum())
        # vLLM's paged layout: the request's valid tokens first, in order.
        assert bool(mask[:valid].all()), "valid slots are a prefix of the gathered pages"

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx < valid

        block_mask = create_block_mask(
            mask_mod, None, None, 1, k.shape[1], device=str(k.device), BLOCK_SIZE=16
        )
        out = attend(
            q.to(dtype)[None, :, None, :],
            k.to(dtype)[None],
            v.to(dtype)[None],
            block_mask=block_mask,
            scale=1.0 / math.sqrt(k.shape[-1]),
            enable_gqa=q.shape[0] != k.shape[0],
        )
        return out[0, :, 0, :].float()

    return run


def kernels(device: torch.device) -> dict[str, Kernel]:
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return {
            "sdpa-math": sdpa(SDPBackend.MATH, torch.float32),
            "flex": flex(torch.float32, compiled=False),
        }
    bf16 = torch.bfloat16
    return {
        "sdpa-math": sdpa(SDPBackend.MATH, bf16),
        "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION, bf16),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, bf16),
        "flex": flex(bf16, compiled=True),
    }


def _outputs(cr: nan_repro.CaseRun, raws: list[torch.Tensor], kernel: Kernel) -> list:
    outs = []
    for q, (kv,), (mask,) in cr.decode_inputs(raws):
        k, v = _split(kv, cr.case, cr.sizes)
        outs.append(kernel(q, k, v, mask))
    return outs


def run_case(case, sizes, device, gen) -> list[dict]:
    cr = nan_repro.CaseRun(case, sizes, device, gen)
    dirty, clean = cr.pools()
    zeroed = [r.clone() for r in dirty]
    zero_kv_blocks(cr.geo.views(zeroed[0]), tails=cr.tails(0), pages_per_block=case.pages_per_block)
    rows = []
    for name, kernel in kernels(device).items():
        row = {"case": case.name, "kernel": name}
        try:
            before = _outputs(cr, [r.clone() for r in dirty], kernel)
            after = _outputs(cr, [r.clone() for r in zeroed], kernel)
            ref = _outputs(cr, [r.clone() for r in clean], kernel)
        except RuntimeError as e:  # e.g. no cuDNN kernel for this shape
            row.update(supported=False, error=str(e).splitlines()[0][:160])
            rows.append(row)
            continue
        row.update(
            supported=True,
            nan_before=sum(int(torch.isnan(o).sum()) for o in before),
            requests_nan_before=sum(bool(torch.isnan(o).any()) for o in before),
            nan_after=sum(int(torch.isnan(o).sum()) for o in after),
            outputs=sum(o.numel() for o in before),
            requests=len(before),
            bit_identical=all(torch.equal(a, b) for a, b in zip(after, ref, strict=True)),
        )
        row["ok"] = row["nan_before"] > 0 and row["nan_after"] == 0 and row["bit_identical"]
        rows.append(row)
    return rows


def run(device: str = "cpu", size: str = "small", seed: int = 0) -> dict:
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    sizes = nan_repro.SIZES[size]
    rows = [
        row
        for case in nan_repro.CASES
        if case.dcp_world == 1
        for row in run_case(case, sizes, dev, gen)
    ]
    supported = [r for r in rows if r["supported"]]
    return {
        "env": nan_repro.environment(dev),
        "rows": rows,
        "ok": bool(supported) and all(r["ok"] for r in supported),
    }


def table(result: dict) -> str:
    lines = [
        "| case | kernel | NaN out before (requests) | NaN out after "
        "| after == clean (bits) | ok |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if not r["supported"]:
            lines.append(f"| {r['case']} | {r['kernel']} | unsupported: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['kernel']} | {r['nan_before']}/{r['outputs']} "
            f"({r['requests_nan_before']}/{r['requests']}) | {r['nan_after']} "
            f"| {r['bit_identical']} | {'PASS' if r['ok'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=tuple(nan_repro.SIZES), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    size = args.size or ("full" if args.device != "cpu" else "small")
    result = run(args.device, size, args.seed)
    env = result["env"]
    print(f"torch {env['torch']}, device {env['device']} ({env['device_name']}), sizes {size}")
    print(table(result))
    print("ALL PASS" if result["ok"] else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
