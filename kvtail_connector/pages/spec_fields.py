"""Every ``AttentionSpec`` field of vLLM 0.32-0.34, sorted by whether it can
change which bytes of a page a token owns.

A page map may only be trusted for specs whose every field it understands: a
field vLLM adds later could reshape the page (as ``num_head_slots``,
``state_content_bytes`` and ``kv_head_major_slots`` did). So a spec holding a
field listed in neither set below with a value other than its default is
refused; ``tests/with_vllm/test_page_maps.py`` fails on any field of the
installed vLLM that is listed in neither.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Fields a page map reads, or that the view already reflects (sizes, dtype,
# padding at the end of a page, tokens per stored state). NAMED: those a
# refusal names with their values, in that order (the others only size the page).
NAMED = (
    "kv_quant_mode",
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "num_head_slots",
    "state_content_bytes",
    "kv_head_major_slots",
    "tokens_per_state",
    "block_stride_alignment",
    "page_size_padded",
    "cache_dtype_str",
    "model_version",
    "cache_role",
)
SHAPES_PAGE = frozenset({"block_size", "alignment", *NAMED})

# Fields about scheduling, parallelism or attention masks: where tokens sit in
# a page does not depend on them.
LEAVES_PAGE = frozenset(
    {
        "dcp_sharded",
        "is_draft",
        "max_tp_shards",
        "sliding_window",
        "attention_chunk_size",
        "non_causal",
        "non_causal_multi_token_decode",
        "extra_retained_tokens",
        "bounded_replay",
        "rswa_window",
        "sink_len",
        "topk_buffer_width",
        "is_index_group_leader",
    }
)

KNOWN_FIELDS = SHAPES_PAGE | LEAVES_PAGE


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def unknown_fields(spec: Any) -> dict[str, Any]:
    """The fields of ``spec`` that no page map knows and that differ from
    their defaults (a required unknown field always counts), by name."""
    if not dataclasses.is_dataclass(spec):
        return {}
    unknown = {}
    for field in dataclasses.fields(spec):
        if field.name in KNOWN_FIELDS:
            continue
        value = getattr(spec, field.name, None)
        if value != _default(field):
            unknown[field.name] = value
    return unknown
