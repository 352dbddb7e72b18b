"""``vllm.general_plugins`` entry point: make ``KVTailConnector`` a known name.

vLLM runs general plugins in every process it starts, so this must be
re-entrant and cheap: it registers a lazy (module, class) pair and imports
nothing heavy. With it, ``kv_connector_module_path`` is optional.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVTailConnector"


def register() -> None:
    """Register ``KVTailConnector`` with vLLM's connector factory (idempotent).

    Raises:
        kvtail_connector._compat.UnsupportedVLLMError: the installed vLLM is
            outside the supported range (one clear message at start-up).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtail_connector import _compat

    _compat.check_vllm_version()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "kvtail_connector.connector", CONNECTOR_NAME
    )
