"""Every bad backend is named at start-up, in one message with the field and the fix.

Out-of-tree modules are written to a temp dir; the registry is patched per
test where a test registers a name of its own.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtail_connector import _compat, plugin
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers.vllm_factories import (
    make_kv_cache_config,
    make_vllm_config,
    refusal_error,
    refusal_text,
)

BACKEND = "kv_connector_extra_config.backend"
MODULE_PATH = "kv_connector_extra_config.backend_module_path"

MODULE = """
from kvtail_connector.facade.connector import KVTailConnector


class NotAConnector:
    def __init__(self, vllm_config, role, kv_cache_config):
        pass


def a_function(vllm_config, role, kv_cache_config):
    pass


A_NUMBER = 3
Alias = KVTailConnector


class MyTail(KVTailConnector):
    pass
"""


@pytest.fixture
def out_of_tree(tmp_path, monkeypatch):
    """Write ``name.py`` with ``source`` on sys.path; returns its module name."""

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(name, None)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    return write


@pytest.fixture
def registry(monkeypatch):
    """Register extra names for one test only."""
    patched = dict(KVConnectorFactory._registry)
    monkeypatch.setattr(KVConnectorFactory, "_registry", patched)

    def register(name: str, module: str, cls: str) -> None:
        KVConnectorFactory.register_connector(name, module, cls)

    return register


def start(extra: dict) -> KVTailConnector:
    return KVTailConnector(
        make_vllm_config(
            **wrapper_fields(extra),
        ),
        KVConnectorRole.SCHEDULER,
        make_kv_cache_config(block_size=16, num_blocks=8),
    )


def refusal(extra: dict) -> str:
    with pytest.raises(ValueError) as info:
        start(extra)
    return refusal_text(info.value)


@pytest.mark.parametrize(
    ("attr", "what"),
    [("NotAConnector", "the class"), ("a_function", "a function"), ("A_NUMBER", "a int")],
)
def test_a_module_path_attribute_that_is_no_connector(out_of_tree, attr, what):
    module = out_of_tree("not_connectors", MODULE)
    text = refusal({"backend": attr, "backend_module_path": module})
    assert text.startswith(f"{BACKEND}: {attr!r} in module {module!r} is {what}")
    assert "not a vLLM KV connector (a subclass of KVConnectorBase_V1)" in text
    assert "Name the connector class to wrap" in text


def test_a_registered_name_that_is_no_connector(out_of_tree, registry):
    module = out_of_tree("not_connectors_registered", MODULE)
    registry("BogusConnector", module, "NotAConnector")
    text = refusal({"backend": "BogusConnector"})
    assert text.startswith(f"{BACKEND}: 'BogusConnector' is the class {module}.NotAConnector")
    assert "KVConnectorBase_V1" in text


@pytest.mark.parametrize(
    "error", ["raise RuntimeError('no device')", "raise OSError(5, 'bad driver')", "1 +"]
)
def test_a_module_path_whose_import_fails_otherwise(out_of_tree, error):
    module = out_of_tree("broken_at_import", f"{error}\n")
    with pytest.raises(ValueError) as info:
        start({"backend": "Anything", "backend_module_path": module})
    text = refusal_text(info.value)
    kind = type(refusal_error(info.value).__cause__).__name__
    assert text.startswith(f"{MODULE_PATH}: importing {module!r} failed with {kind}")
    assert "Fix that module" in text
    assert kind in ("RuntimeError", "OSError", "SyntaxError")


def test_a_registered_module_whose_import_fails_otherwise(out_of_tree, registry):
    module = out_of_tree("broken_registered", "raise RuntimeError('no device')\n")
    registry("BrokenConnector", module, "BrokenConnector")
    text = refusal({"backend": "BrokenConnector"})
    assert text.startswith(
        f"{BACKEND}: loading the registered connector 'BrokenConnector' failed with "
        "RuntimeError: no device"
    )


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        ({"backend": "KVTailConnector"}, "is KVTailConnector"),
        ({"backend": "KVTailConnector", "backend_module_path": "kvtail_connector"}, "is KVTail"),
        ({"backend": "Alias", "backend_module_path": "{module}"}, "is KVTailConnector"),
        ({"backend": "MyTail", "backend_module_path": "{module}"}, "a subclass of KVTailConnector"),
        ({"backend": "TailAlias"}, "is KVTailConnector"),
    ],
)
def test_the_wrapper_cannot_wrap_itself_under_any_name(out_of_tree, registry, extra, what):
    module = out_of_tree("tail_aliases", MODULE)
    plugin.register()  # as in every vLLM process: the name KVTailConnector is known
    registry("TailAlias", "kvtail_connector.facade.connector", "KVTailConnector")
    extra = {k: v.format(module=module) for k, v in extra.items()}
    text = refusal(extra)
    assert text.startswith(f"{BACKEND}: {extra['backend']!r}")
    assert what in text and "the wrapper cannot wrap itself" in text
    assert 'Name the connector it should wrap (e.g. "NixlConnector")' in text


def test_stray_spaces_around_the_backend_are_dropped():
    wrapper = start({"backend": "  NixlConnector "})
    assert type(wrapper.inner).__name__ == "NixlPullConnector"


@pytest.mark.parametrize(
    "extra",
    [{"backend": "NoSuchConnector"}, {"backend": "KVTailConnector"}, {"zero_tails": "always"}],
    ids=["unknown", "itself", "no-backend"],
)
def test_the_classmethods_refuse_as_the_build_does(extra):
    # vLLM asks them before (or without) building the connector: one
    # resolution, one message, whichever asks first.
    message = refusal(extra)
    # A config vLLM accepts, then the bad transfer config in its place: vLLM
    # 0.34 asks kv_cache_access while it validates VllmConfig (the first ask).
    vllm_config = make_vllm_config(**wrapper_fields({"backend": "NixlConnector"}))
    transfer = KVTransferConfig(kv_role="kv_both", **wrapper_fields(extra))
    vllm_config.kv_transfer_config = transfer
    asks = [
        lambda: KVTailConnector.get_required_kvcache_layout(vllm_config),
        lambda: KVTailConnector.requires_piecewise_for_cudagraph(extra),
        lambda: KVTailConnector.supports_sleep_mode(transfer),
        lambda: KVTailConnector.supports_lookahead_block_hashes(transfer),
        lambda: KVTailConnector.kv_cache_access(transfer),
    ]
    if _compat.check_vllm_version() >= (0, 34):  # asked while VllmConfig validates
        asks.append(lambda: make_vllm_config(**wrapper_fields(extra)))
    for ask in asks:
        with pytest.raises(ValueError) as info:
            ask()
        assert refusal_text(info.value) == message
