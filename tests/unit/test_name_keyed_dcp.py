"""The NIXL DCP rules vLLM keys on the name, on configs this CPU cannot build.

A faithful NIXL DCP config needs an MLA model with TP = DCP, which vLLM refuses
to build on a CPU without AMX tiles (tests/helpers/vllm_factories.py); the real
config path of the MLA refusal is in tests/scheduler/test_name_keyed.py. Here
the config is a test double with the fields the rules read, and the transfer
config's ``has_connector`` is vLLM's rule (the name, or a MultiConnector child).
"""

from types import SimpleNamespace

import pytest

from kvtail_connector.facade import name_keyed


class Transfer:
    def __init__(self, name: str, children: tuple[str, ...] = ()) -> None:
        self.kv_connector = name
        self.children = children

    def has_connector(self, name: str) -> bool:
        return self.kv_connector == name or (
            self.kv_connector == "MultiConnector" and name in self.children
        )


def config(dcp: int, tp: int, interleave: int, block_size: int = 64, mla: bool = True, auto=True):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp,
            tensor_parallel_size=tp,
            prefill_context_parallel_size=1,
            cp_kv_cache_interleave_size=interleave,
            # False where the user set the interleave (vLLM then keeps it).
            _allow_auto_resolve_cp_interleave_size=auto,
        ),
        model_config=SimpleNamespace(use_mla=mla),
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=False),
        aux_output_config=SimpleNamespace(enabled=False),
    )


def check(cfg, transfer, children=(), kv_block_size=None):
    name_keyed.check_start_up(
        cfg,
        transfer,
        "backend (X)",
        children=children,
        has_mamba=False,
        is_worker=False,
        kv_block_size=kv_block_size,
    )


def test_an_explicit_interleave_is_kept_as_vllm_keeps_it():
    # vLLM changes the interleave only where the user did not set it.
    check(config(dcp=8, tp=8, interleave=1, auto=False), Transfer("NixlConnector"))


def test_the_interleave_vllm_would_set_is_the_smallest_kv_group_block():
    # vLLM sets it to the smallest KV cache group block size, not the cache
    # config's block size.
    with pytest.raises(ValueError, match="--cp-kv-cache-interleave-size 16 \\(now 64\\)"):
        check(config(dcp=8, tp=8, interleave=64), Transfer("NixlConnector"), kv_block_size=16)
    check(config(dcp=8, tp=8, interleave=16), Transfer("NixlConnector"), kv_block_size=16)


def test_interleave_vllm_would_set_is_required_and_named():
    with pytest.raises(ValueError, match="--cp-kv-cache-interleave-size 64 \\(now 1\\)"):
        check(config(dcp=8, tp=8, interleave=1), Transfer("NixlConnector"))
    check(config(dcp=8, tp=8, interleave=64), Transfer("NixlConnector"))


def test_dcp_size_must_be_one_or_the_transfer_tp():
    with pytest.raises(ValueError, match="NIXL transfer parallel size=8"):
        check(config(dcp=4, tp=8, interleave=64), Transfer("NixlConnector"))


def test_a_nixl_child_is_named_and_other_names_are_not_checked():
    multi = Transfer("MultiConnector", ("MooncakeStoreConnector", "NixlConnector"))
    children = [("connectors[0] (MooncakeStoreConnector)", "MooncakeStoreConnector")]
    children.append(("connectors[1] (NixlConnector)", "NixlConnector"))
    with pytest.raises(ValueError, match=r"^connectors\[1\] \(NixlConnector\) behind"):
        check(config(dcp=8, tp=8, interleave=1), multi, children)
    # vLLM keys these rules on "NixlConnector" alone.
    check(config(dcp=8, tp=8, interleave=1), Transfer("NixlPullConnector"))
    check(config(dcp=1, tp=8, interleave=1), Transfer("NixlConnector"))
