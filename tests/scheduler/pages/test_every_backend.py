"""Every attention backend of the installed vLLM, with every kv_cache_dtype it
declares, meets the page decision (``pages.layer_cache``): mapped by a named
layout or refused at start-up, and the outcome is the one the inventory
(``backend_inventory.json``) records for this release.

The walk (``tests/helpers/backend_walk.py``): ``AttentionBackendEnum``'s
members and every module-level class of the vLLM tree defining
``customize_spec``, each asked for the spec of each dtype (its
``customize_attention_spec`` over a base spec), the view vLLM allocates from
it, and a ``LayerDouble`` naming it. A backend or layout a new vLLM adds is a
key the inventory lacks: CI fails until it is mapped or refused in
``kvtail_connector/pages`` and recorded here. Model backends that reshape
nothing and are not selectable (indexer caches, summary caches...) are not
walked: their layers' specs come from the model, and the model page tests
(``test_*_pages.py``) build them.

Regenerate this release's outcomes (then merge them into the inventory by
hand or with ``merge``): ``python -m tests.scheduler.pages.test_every_backend``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from kvtail_connector import _compat
from kvtail_connector.pages import MAPS, LayerPage, UnmappedPage, layer_cache
from tests.helpers import backend_walk as walk

INVENTORY = Path(__file__).with_name("backend_inventory.json")
RELEASE = "{}.{}".format(*_compat.check_vllm_version())

# Bases no layer names as its backend: not walked.
EXCLUDED = {
    "vllm.v1.attention.backend.AttentionBackend": (
        "the abstract base of every backend (its customize_spec is the identity)"
    ),
    "vllm.model_executor.layers.attention.mla_attention.MLACommonBackend": (
        "the MLA backends' shared base (its customize_spec packs per-token-head "
        "scales); each selectable MLA backend is walked itself"
    ),
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse._FlashInferMLASparseBackendBase": (
        "private base of FLASHINFER_MLA_SPARSE and FLASHINFER_MLA_SPARSE_SM120, walked"
    ),
}

# Backends whose module cannot be imported on this CPU machine even with the
# stubs (stub_imports, backend_walk.cpu_import_shims), per release.
_CUDA_AT_IMPORT = "its module calls torch.cuda at import (no CUDA build here)"
UNIMPORTABLE: dict[str, tuple[frozenset[str], str]] = {
    "vllm.models.deepseek_v4.amd.rocm.DeepseekV4ROCMAiterMLASparseBackend": (
        frozenset({"0.32", "0.33", "0.34"}),
        _CUDA_AT_IMPORT,
    ),
    "vllm.models.deepseek_v41.amd.rocm.DeepseekV41ROCMAiterMLASparseBackend": (
        frozenset({"0.33", "0.34"}),
        _CUDA_AT_IMPORT,
    ),
    "vllm.v1.attention.backends.mla.cutlass_mla.CutlassMLABackend": (
        frozenset({"0.32", "0.33", "0.34"}),
        _CUDA_AT_IMPORT,
    ),
    "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend": (
        frozenset({"0.33", "0.34"}),
        _CUDA_AT_IMPORT,
    ),
    "vllm.v1.attention.backends.no_attention.NoAttentionBackend": (
        frozenset({"0.32", "0.33", "0.34"}),
        "AttentionBackendEnum.NO_ATTENTION names a module vLLM does not ship",
    ),
}

# The outcome of a combination vLLM itself refuses (its customize_spec or ISA
# choice raises): no layer of it exists, so no page reaches a map.
VLLM_REJECTS = "vllm-rejects"
REFUSED = "refused"
# CPU_ATTN's pages depend on the ISA the host's vLLM picks: derived per host.
FROM_HOST_ISA = "from-host-isa"
# CPU_ATTN where this release's CPU build is not installed (the 0.33/0.34
# overlays are CUDA wheels): no CPU engine of it can run here, and the cpu map
# has no writer to learn the pages from.
NO_CPU_BUILD = "no-cpu-build-here"
# The ISAs whose CPU writers the cpu map learns exactly (pages/cpu.py).
LEARNED_ISAS = frozenset({"vec", "vec16", "amx"})

FIX = (
    "map or refuse the layout in kvtail_connector/pages (a PageMap, or pages/refused.py "
    "with the reason and the setting that works), then record the outcome in "
    "tests/scheduler/pages/backend_inventory.json ("
    "python -m tests.scheduler.pages.test_every_backend prints this release's)"
)


def key(path: str, kv_cache_dtype: str) -> str:
    return f"{path} | {kv_cache_dtype}"


def mapped(layout: str) -> str:
    return f"mapped: {layout}"


@dataclass
class Walk:
    """What this release's backends publish, and what the page decision says."""

    outcomes: dict[str, str] = field(default_factory=dict)  # key -> outcome
    unimportable: dict[str, str] = field(default_factory=dict)  # path -> error
    excluded: set[str] = field(default_factory=set)  # walked paths skipped as bases
    host_isa: dict[str, str] = field(default_factory=dict)  # CPU_ATTN key -> expected
    errors: list[str] = field(default_factory=list)  # outcomes neither map nor refusal


def _outcome(pub: walk.Published) -> str:
    """``mapped: <layout>``, ``refused`` or ``vllm-rejects``.

    Raises:
        Exception: anything else the decision raises (a bug).
    """
    try:
        layer = walk.layer_for(pub)
    except NotImplementedError:
        return VLLM_REJECTS
    name = "model.layers.0.self_attn.attn"
    try:
        layer_cache(name, pub.view, pub.spec, layer)
    except UnmappedPage:
        return REFUSED
    page = LayerPage(name, pub.view, pub.spec, layer)
    (found,) = [m for m in MAPS if page.backend_path in m.backends and m.covers(page)]
    return mapped(found.layout)


def _cpu_build_here() -> bool:
    import torch

    return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache")


def _cpu_expected(pub: walk.Published) -> str:
    """CPU_ATTN's outcome from what this host's vLLM reports: its ISA choice
    (``_get_attn_isa``) and whether its CPU cache writer is built here."""
    if not _cpu_build_here():
        return NO_CPU_BUILD
    try:
        layer = walk.layer_for(pub)
    except NotImplementedError:
        return VLLM_REJECTS
    if layer.isa not in LEARNED_ISAS:
        return f"unknown ISA {layer.isa!r}"
    from kvtail_connector.pages import cpu

    return mapped(cpu.CPU_ATTN.layout)


@cache
def run_walk() -> Walk:
    result = Walk()
    for path in walk.backend_paths():
        if path in EXCLUDED:
            result.excluded.add(path)
            continue
        try:
            backend = walk.load(path)
        except Exception as e:  # recorded: the test checks the list
            result.unimportable[path] = f"{type(e).__name__}: {e}"[:200]
            continue
        for pub in walk.published(backend):
            if isinstance(pub, tuple):
                result.outcomes[key(pub[0], pub[1])] = VLLM_REJECTS
                continue
            k = key(*pub.key)
            if path == walk.CPU_ATTN:
                result.host_isa[k] = _cpu_expected(pub)
                if not _cpu_build_here():
                    result.outcomes[k] = NO_CPU_BUILD
                    continue
            try:
                result.outcomes[k] = _outcome(pub)
            except Exception as e:
                result.errors.append(f"{k}: {type(e).__name__}: {e}")
    return result


def expected_outcomes(inventory: Mapping, release: str) -> dict[str, str]:
    """The inventory's outcomes for ``release``: the common ones, overridden
    or added to by the release's own section."""
    return {**inventory["common"], **inventory.get(release, {})}


def merge(per_release: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """One inventory from each release's outcomes: ``common`` holds what every
    release gives alike, each release's section the rest."""
    releases = sorted(per_release)
    keys = set.intersection(*(set(per_release[r]) for r in releases))
    common = {
        k: per_release[releases[0]][k]
        for k in sorted(keys)
        if len({per_release[r][k] for r in releases}) == 1
    }
    out: dict[str, dict[str, str]] = {"common": common}
    for r in releases:
        out[r] = {k: v for k, v in sorted(per_release[r].items()) if k not in common}
    return out


@pytest.fixture(scope="module")
def inventory() -> dict:
    return json.loads(INVENTORY.read_text())


def test_every_backend_and_dtype_is_mapped_or_refused():
    errors = run_walk().errors
    assert not errors, "page decisions that neither map nor refuse:\n" + "\n".join(errors)


def test_outcomes_are_the_inventory_of_this_release(inventory):
    got = run_walk().outcomes
    expected = expected_outcomes(inventory, RELEASE)
    for k, v in list(expected.items()):
        if v == FROM_HOST_ISA and k in run_walk().host_isa:
            expected[k] = run_walk().host_isa[k]
    new = sorted(set(got) - set(expected))
    gone = sorted(set(expected) - set(got))
    changed = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
    lines = [f"vLLM {RELEASE}:"]
    lines += [f"  new: {k} -> {got[k]}" for k in new]
    lines += [f"  changed: {k}: inventory {expected[k]!r}, now {got[k]!r}" for k in changed]
    lines += [f"  gone: {k} (remove it from the inventory)" for k in gone]
    assert not (new or gone or changed), "\n".join(lines) + f"\nTo fix: {FIX}."


def test_the_unimportable_list_is_current():
    got = run_walk().unimportable
    listed = {p for p, (releases, _) in UNIMPORTABLE.items() if RELEASE in releases}
    new = {p: got[p] for p in sorted(set(got) - listed)}
    now_importable = sorted(listed - set(got))
    assert not new, (
        f"vLLM {RELEASE}: backends that cannot be imported here, not in UNIMPORTABLE "
        f"(stub what they need in backend_walk.cpu_import_shims, or list them with the "
        f"reason): {new}"
    )
    assert not now_importable, (
        f"vLLM {RELEASE}: now importable, drop them from UNIMPORTABLE for this release "
        f"and record their outcomes in the inventory: {now_importable}"
    )


def test_excluded_bases_still_exist():
    assert run_walk().excluded == set(EXCLUDED), (
        f"vLLM {RELEASE}: EXCLUDED names bases this release lacks: "
        f"{sorted(set(EXCLUDED) - run_walk().excluded)}"
    )


if __name__ == "__main__":
    outcomes = dict(run_walk().outcomes)
    for k in run_walk().host_isa:
        outcomes[k] = FROM_HOST_ISA
    json.dump({RELEASE: dict(sorted(outcomes.items()))}, sys.stdout, indent=1)
    print()
