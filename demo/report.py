"""The demo's printed table: one line per request and connector."""

from __future__ import annotations

from collections.abc import Sequence

from demo.scenarios import Outcome, Row

HEADERS = (
    "prompt",
    "connector",
    "loaded",
    "stale tail",
    "NaN planted",
    "probe: stale bytes",
    "bytes zeroed",
    "NaN left in decode",
    "output = 1 engine",
)


LEGEND = [
    "loaded: tokens the decode engine's connector loaded.  stale tail: slots of the last loaded "
    "block after the loaded",
    "tokens; their bytes are not this request's KV (the block's previous contents, or the "
    "producer's, copied with the",
    "block).  probe: non-zero bytes the wrapper found there before zeroing "
    "(vllm:kvtail_stale_nonzero_bytes);",
    "bytes zeroed: vllm:kvtail_tail_bytes_zeroed; both for this request.  NaN left: NaN values "
    "in the decode engine's",
    "KV blocks of the request after decoding.  output = 1 engine: the same greedy tokens as the "
    "prompt run on one engine.",
]


def _num(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _cells(r: Row) -> tuple[str, ...]:
    if r.output_ok:
        output = "yes"
    elif r.decode_failed_log is not None:
        output = "NO: load failed, request ended in error"
    else:
        output = f"NO {r.tokens[:4]}.. vs {r.reference[:4]}.."
    probe = _num(r.probe_nonzero_bytes)
    if r.probe_nonfinite:
        probe += f" ({r.probe_nonfinite:,} non-finite)"
    return (
        str(r.prompt_len),
        r.connector,
        _num(r.hit),
        f"slots {r.tail[0]}-{r.tail[1] - 1}" if r.tail else "none",
        _num(r.planted_nan) if r.planted_nan else "-",
        probe,
        _num(r.bytes_zeroed),
        _num(r.nan_left),
        output,
    )


def table(rows: Sequence[Row]) -> str:
    cells = [HEADERS] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]

    def line(c: Sequence[str]) -> str:
        return "  ".join(
            s.ljust(w) if i in (1, 3, 8) else s.rjust(w)
            for i, (s, w) in enumerate(zip(c, widths, strict=True))
        ).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    prev = None
    for r, c in zip(rows, cells[1:], strict=True):
        if prev is not None and r.prompt_len != prev:
            out.append("")
        prev = r.prompt_len
        out.append(line(c))
    return "\n".join(out)


def render(o: Outcome) -> str:
    sc = o.scenario
    lines = [f"== {sc.title}", *(f"   {n}" for n in sc.notes)]
    lines.append(
        f"   attention block: {o.attn_block_size} tokens; CPU attention ISA: {o.attn_isa}; "
        f"needs_kv_cache_zeroing={o.needs_kv_cache_zeroing}; engines started in "
        f"{o.startup_s:.0f} s"
    )
    lines += ["", table(o.rows), ""]
    lines += LEGEND
    return "\n".join(lines)
