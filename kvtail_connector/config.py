"""``KVTailConfig``: the wrapper's ``kv_connector_extra_config``, parsed once.

Everything else in the package receives plain values derived from it; nothing
re-reads the user's dict, and nothing writes to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
)

PREFIX = "kv_connector_extra_config"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

_FIELD_HELP = {
    "backend": 'the connector to wrap, e.g. "NixlConnector", "MooncakeStoreConnector" or '
    '"MoRIIOConnector" (or a class name in backend_module_path)',
    "backend_module_path": "a Python module path that defines the backend class",
    "backend_extra_config": "a JSON object passed to the backend as its kv_connector_extra_config",
    "zero_tails": 'one of "auto" (zero when vLLM zeroes new blocks), "always" or "off"',
    "probe_stale_tails": "true or false (a JSON boolean, not a string or a number)",
    "vouch_tails": 'one of "auto" (consumers check claims and skip only per-layer MoRIIO READ '
    'tails; producers vouch only there), "trust" (producers zero and vouch for every '
    'remote-decode prompt tail; consumers skip every tail a bound claim covers) or "off"',
    "entry_key_env": "the NAME of an environment variable holding the shared key (never the "
    "key itself), e.g. KVTAIL_ENTRY_KEY",
    "verify_kv": 'one of "off", "digest" (producers send a digest of each remote-decode '
    "prompt's KV, consumers check what they loaded and report a mismatch as a failed load), "
    '"auto" (digest wherever it can work, off elsewhere) or "sample" (as "auto", producers '
    "digesting one remote-decode request in every verify_kv_every)",
    "verify_kv_every": "an integer from 1 to 1024 (how many remote-decode requests a producer "
    'serves per digested one under verify_kv "sample")',
}


class KVTailConfig(BaseModel):
    """The wrapper's settings (``kv_transfer_config.kv_connector_extra_config``).

    Attributes:
        backend: the inner connector, the one the wrapper wraps (NIXL,
            MooncakeStore, MoRIIO, MultiConnector...): a name registered with
            vLLM's ``KVConnectorFactory`` or, with ``backend_module_path``, a
            class name in that module. The field keeps its public name; the
            code calls this connector "inner" (``kvtail_connector.facade.inner``
            resolves it, ``connectors.InnerAdapter`` says what differs per
            class). It
            has nothing to do with the attention backend or the zeroer's
            kernel backend.
        backend_module_path: module defining ``backend`` (out-of-tree).
        backend_extra_config: the inner connector's
            ``kv_connector_extra_config``, passed through untouched.
        zero_tails: ``auto`` zeroes stale tails exactly when vLLM zeroes new
            blocks (``kv_cache_config.needs_kv_cache_zeroing``: Mamba layers
            or mixed-precision caches); ``always`` for every model; ``off``
            zeroes no async-load tails (MoRIIO READ exclusion and metrics
            stay; on a model vLLM zeroes, the producer tails that READs copy
            into blocks kept from vLLM's zeroing are still zeroed, so no
            setting zeroes less than vLLM would).
        probe_stale_tails: before zeroing, count non-zero and non-finite tail
            bytes, log a warning for non-finite ones, and count them. On a
            consumer it also checks the async-load tails it skips on a
            producer's claim (the canary: non-zero bytes there are zeroed and
            counted as ``false_vouches``); vouched MoRIIO READ tails it skips
            are not checked.
        vouch_tails: ``auto`` (the default): a consumer checks a producer's
            claim (counted) but still zeroes every async load's tail itself,
            and skips only MoRIIO READ tails zeroed per layer (vLLM 0.32),
            where skipping saves milliseconds per step; a producer vouches
            only where such a consumer may skip on the claim (MoRIIO READ on
            a vLLM that zeroes READ tails per layer, judged by the producer's
            own vLLM): elsewhere its zeroing would be paid for nothing, and a
            plain or non-zeroing consumer gets the producer's tail as it is.
            ``trust``: a producer whose transfer
            carries its whole blocks (NIXL, MoRIIO READ) zeroes the slots past
            each remote-decode prompt in its last block and adds a ``kvtail``
            entry saying so to the request's ``kv_transfer_params``; a
            consumer skips every tail a bound claim for its geometry and
            length covers. ``off``: neither (a consumer then zeroes as if no
            entry came).
        entry_key_env: the name of an environment variable holding a key
            shared by producers and consumers (read once at start-up; named
            but unset or empty is refused). A producer then adds an
            HMAC-SHA256 to its entry; a consumer trusts and uses only entries
            whose HMAC verifies. None (the default): no key.
        verify_kv: ``digest``: a producer digests each remote-decode prompt's
            KV in the step that completes it (per KV cache group, global KV
            head and token segment) and adds the sums to its ``kvtail`` entry;
            a consumer digests what an async load wrote, holds the completion
            until the sums are on the host, and reports a mismatch as a failed
            load (vLLM's ``kv_load_failure_policy`` applies); refused at
            start-up where it cannot work (see
            :func:`~kvtail_connector.core.policy.resolve_policy`). ``auto``: the
            same wherever it can work, off elsewhere (the start-up INFO line
            says why); a load that comes with no digest is counted in
            ``digests_absent``. ``sample``: as ``auto``, but a producer
            digests one remote-decode request in every ``verify_kv_every`` it
            serves (the first of each run of that many, counted by the
            producer alone: no request can opt in or out), so a fault that hits
            every transfer is caught within that many requests; a consumer
            checks every load that comes with a digest. This is the default: an
            alarm for faults that hit every transfer, at about 1/32 of the
            digest's cost (benchmarks/RESULTS.md §6). ``off``: neither.
        verify_kv_every: with ``verify_kv: sample``, how many remote-decode
            requests a producer serves per digested one (1 to 1024; 32 by
            default). Ignored by the other settings, which digest every request.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str
    backend_module_path: str | None = None
    backend_extra_config: dict[str, Any] = Field(default_factory=dict)
    zero_tails: Literal["auto", "always", "off"] = "auto"
    # Strict: "yes", "false" or 1 would otherwise parse as booleans.
    probe_stale_tails: StrictBool = False
    vouch_tails: Literal["auto", "trust", "off"] = "auto"
    entry_key_env: str | None = None
    verify_kv: Literal["off", "digest", "auto", "sample"] = "sample"
    verify_kv_every: int = Field(default=32, ge=1, le=1024, strict=True)

    @field_validator("backend", "backend_module_path")
    @classmethod
    def _stripped(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Names and module paths never contain spaces: surrounding ones (shell
        # quoting, hand-written JSON) are dropped rather than refused.
        if value is None:
            return None
        value = value.strip()
        if not value:
            raise ValueError(f"must not be blank; expected {_FIELD_HELP[str(info.field_name)]}")
        return value

    @field_validator("entry_key_env")
    @classmethod
    def _variable_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not an environment variable name; expected "
                f"{_FIELD_HELP['entry_key_env']}"
            )
        return value

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KVTailConfig:
        """Parse ``kv_connector_extra_config``; errors name the field and the fix.

        Raises:
            ValueError: one message listing every problem.
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"{PREFIX}: expected a JSON object, got {type(extra).__name__}")
        try:
            return cls.model_validate(dict(extra))
        except ValidationError as e:
            raise ValueError(_explain(e)) from None


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _explain(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        name = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            known = ", ".join(KVTailConfig.model_fields)
            hint = f"unknown field; the wrapper takes {known}"
            if name not in KVTailConfig.model_fields:
                hint += " (the backend's own settings go in backend_extra_config)"
        elif err["type"] == "missing":
            hint = f"required: {_FIELD_HELP.get(name, 'set it')}"
        elif err["type"] == "value_error":
            # Our validators' own sentences, without pydantic's "Value error, ".
            hint = str(err.get("ctx", {}).get("error", err["msg"]))
        else:
            hint = f"got {_shown(err['input'])}; expected {_FIELD_HELP.get(name, 'a valid value')}"
        lines.append(f"{PREFIX}.{field}: {hint}")
    return "invalid KVTailConnector configuration:\n  " + "\n  ".join(lines)
