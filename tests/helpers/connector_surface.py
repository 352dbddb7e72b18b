"""What vLLM can ask a KV connector, and whether ``KVTailConnector`` answers as the one inside.

DESIGN §0.2: wrapped, vLLM must see the inner connector. Every public name of
the installed release's ``KVConnectorBase_V1`` and of the mixins connectors
take from the same module (``SupportsHMA``...) is either checked here by
behaviour, or listed by the facade as its own answer with the reason
(:data:`kvtail_connector.facade.connector.OWN_ANSWERS`). A name that is neither (one
a new release adds) is reported by :func:`unclassified`:
``tests/scheduler/test_connector_surface.py`` fails on it, and
``scripts/vllm-release-check`` prints it.

Three kinds of checks, each comparing the wrapped config with the plain one:

* class questions (:data:`CLASS_QUESTIONS`), asked of the connector class as
  vLLM asks them (the class resolved from the config by
  ``KVConnectorFactory``), before any connector exists;
* instance questions (:data:`INSTANCE_QUESTIONS`): properties and
  side-effect-free queries of a scheduler-side connector built by the factory;
* hooks (:data:`HOOKS`): calls whose effect is the inner connector's, and the
  questions only a worker answers (real workers need transports and devices
  this machine lacks). A wrapper around the recording double
  (``tests/helpers/recording.py``) must pass the call on with the same
  arguments and return the inner's answer where the base method returns one.

The questions run on :data:`CASES`: NIXL (device and host buffers),
MooncakeStore, MoRIIO, a MultiConnector of NIXL and MooncakeStore wrapped, a
plain MultiConnector with the wrapper as a child, and the recording double,
each as producer and as consumer (:data:`ROLES`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
ROLES = ("kv_producer", "kv_consumer")


# --------------------------------------------------------------- the surface


def base_classes() -> tuple[type, ...]:
    """``KVConnectorBase_V1`` and the mixins of its module (vLLM names them ``Supports*``)."""
    import importlib

    base = importlib.import_module(BASE_MODULE)
    mixins = [
        obj
        for name, obj in sorted(vars(base).items())
        if isinstance(obj, type) and obj.__module__ == BASE_MODULE and name.startswith("Supports")
    ]
    return (base.KVConnectorBase_V1, *mixins)


@dataclass(frozen=True)
class PublicName:
    """One public name of the base classes.

    Attributes:
        owner: the class defining it.
        kind: "method", "classmethod", "staticmethod", "property" or "attribute".
        answers: vLLM reads what it returns (a property, or a method whose
            return annotation is neither absent nor None).
    """

    name: str
    owner: str
    kind: str
    answers: bool


def _kind(raw: Any) -> tuple[str, Any]:
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    if isinstance(raw, property):
        return "property", None
    if inspect.isfunction(raw):
        return "method", raw
    return "attribute", None


def _answers(kind: str, func: Any) -> bool:
    if kind in ("property", "attribute"):
        return True
    returns = inspect.signature(func).return_annotation
    return returns not in (None, "None", inspect.Signature.empty)


def public_names() -> dict[str, PublicName]:
    """Every public name the installed release's base classes define, by name."""
    names: dict[str, PublicName] = {}
    for cls in base_classes():
        for klass in cls.__mro__:
            if klass.__module__ != BASE_MODULE:
                continue  # ABC, object
            for name, raw in vars(klass).items():
                if name.startswith("_") or name in names:
                    continue
                kind, func = _kind(raw)
                names[name] = PublicName(name, klass.__name__, kind, _answers(kind, func))
    return names


def own_answers() -> Mapping[str, str]:
    from kvtail_connector.facade.connector import OWN_ANSWERS

    return OWN_ANSWERS


def unclassified() -> list[PublicName]:
    """Public names the wrapper neither has a forwarding check for nor lists as its own."""
    checked = set(CLASS_QUESTIONS) | set(INSTANCE_QUESTIONS) | set(HOOKS)
    own = own_answers()
    return [n for name, n in sorted(public_names().items()) if name not in checked | set(own)]


# ------------------------------------------------------------------- the cases


def _nixl(role: str, buffer: str = "cuda") -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": buffer}


def _mooncake_store(role: str) -> dict[str, Any]:
    return {"kv_connector": "MooncakeStoreConnector", "kv_role": role}


def _moriio(role: str) -> dict[str, Any]:
    # host_ip keeps MoRIIO's scheduler from looking its address up.
    extra = {"read_mode": "true", "host_ip": "127.0.0.1"}
    return {"kv_connector": "MoRIIOConnector", "kv_role": role, "kv_connector_extra_config": extra}


def _multi(role: str, children: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": children},
    }


def _recording(role: str) -> dict[str, Any]:
    from tests.helpers import recording

    return {
        "kv_connector": "RecordingConnector",
        "kv_connector_module_path": recording.MODULE_PATH,
        "kv_role": role,
        "kv_connector_extra_config": {"inner": "settings"},
    }


def _wrap(plain: dict[str, Any]) -> dict[str, Any]:
    from kvtail_connector.facade.inner import wrap_kv_transfer_config

    # zero_tails off: no duty of the wrapper's may touch what the checks compare.
    return wrap_kv_transfer_config(plain, zero_tails="off")


@dataclass(frozen=True)
class Case:
    """A plain ``kv_transfer_config`` and the same connector behind the wrapper."""

    name: str
    role: str
    plain: dict[str, Any]
    wrapped: dict[str, Any]


def _cases_for(role: str) -> Iterator[Case]:
    simple = {
        "nixl": _nixl(role),
        "nixl_host_buffer": _nixl(role, buffer="cpu"),
        "mooncake_store": _mooncake_store(role),
        "moriio": _moriio(role),
        "multi": _multi(role, [_nixl(role), _mooncake_store(role)]),
        "recording_double": _recording(role),
    }
    for name, plain in simple.items():
        yield Case(name, role, plain, _wrap(plain))
    # The wrapper as a plain MultiConnector's child: vLLM asks MultiConnector,
    # which asks each child's class (KVTailConnector) with the child's config.
    yield Case(
        "multi_child",
        role,
        _multi(role, [_nixl(role), _mooncake_store(role)]),
        _multi(role, [_wrap(_nixl(role)), _mooncake_store(role)]),
    )


CASE_NAMES = (
    "nixl",
    "nixl_host_buffer",
    "mooncake_store",
    "moriio",
    "multi",
    "multi_child",
    "recording_double",
)


def case(name: str, role: str) -> Case:
    (found,) = [c for c in _cases_for(role) if c.name == name]
    return found


def _transfer_config(fields: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**fields)


def _connector_class(ktc: Any) -> type:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(ktc)


def _vllm_config(fields: dict[str, Any]) -> Any:
    """A validated engine config whose transfer config is exactly ``fields``."""
    from tests.helpers.vllm_factories import make_vllm_config

    vllm_config = make_vllm_config(
        kv_connector=fields["kv_connector"],
        kv_connector_module_path=fields.get("kv_connector_module_path"),
        kv_role=fields["kv_role"],
        kv_connector_extra_config=fields.get("kv_connector_extra_config"),
    )
    # kv_buffer_device: make_vllm_config takes the platform's default.
    vllm_config.kv_transfer_config = _transfer_config(fields)
    return vllm_config


# ------------------------------------------------------------- class questions


def _kv_cache_access(fields: dict[str, Any]) -> Any:
    # vLLM's entry point (KVTransferConfig.kv_cache_access): the factory's
    # resolution, with its LMCacheMP fallback.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.kv_cache_access(_transfer_config(fields))  # type: ignore[attr-defined]


def _ask_class(method: str) -> Callable[[dict[str, Any]], Any]:
    def ask(fields: dict[str, Any]) -> Any:
        ktc = _transfer_config(fields)
        return getattr(_connector_class(ktc), method)(ktc)

    return ask


CLASS_QUESTIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    # Engine core, after the model is loaded.
    "get_required_kvcache_layout": lambda f: _connector_class(
        _transfer_config(f)
    ).get_required_kvcache_layout(_vllm_config(f)),
    # VllmConfig, on static-graph platforms; vLLM passes the extra config only.
    "requires_piecewise_for_cudagraph": lambda f: _connector_class(
        _transfer_config(f)
    ).requires_piecewise_for_cudagraph(f.get("kv_connector_extra_config") or {}),
    "supports_sleep_mode": _ask_class("supports_sleep_mode"),  # 0.33
    "supports_lookahead_block_hashes": _ask_class("supports_lookahead_block_hashes"),  # 0.34
    "kv_cache_access": _kv_cache_access,  # 0.34
}


def _outcome(ask: Callable[[], Any]) -> tuple[str, Any]:
    """What a question gave: its answer, or the type of what it raised (an
    answer too: vLLM stops there, plain or wrapped)."""
    try:
        return "answered", ask()
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return "raised", type(exc).__name__


def class_question_mismatches(c: Case, names: Iterable[str] | None = None) -> list[str]:
    """``name: plain ... != wrapped ...`` for each class question whose answers differ."""
    present = public_names()
    wanted = set(CLASS_QUESTIONS) if names is None else set(names)
    found = []
    for name, ask in CLASS_QUESTIONS.items():
        if name not in present or name not in wanted:
            continue
        plain = _outcome(lambda ask=ask: ask(c.plain))
        wrapped = _outcome(lambda ask=ask: ask(c.wrapped))
        if plain != wrapped:
            found.append(f"{name} ({c.name}, {c.role}): plain {plain} != wrapped {wrapped}")
    return found


# ---------------------------------------------------------- instance questions


def _requests() -> list[Any]:
    """A remote prefill (a consumer's load), a remote decode (a producer's
    prompt) and a local request, as the questions' arguments."""
    from tests.helpers.vllm_factories import make_request

    remote_prefill = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "peer",
        "remote_request_id": "prefill",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    return [
        make_request("prefill", 40, block_size=16, kv_transfer_params=remote_prefill),
        make_request("decode", 40, block_size=16, kv_transfer_params={"do_remote_decode": True}),
        make_request("local", 40, block_size=16),
    ]


InstanceAsk = Callable[[Any, list[Any]], Any]

# Side-effect-free questions only: reset_cache (MooncakeStore: a ZMQ request to
# worker 0 that no test peer answers) is checked as a hook, on the double.
INSTANCE_QUESTIONS: dict[str, InstanceAsk] = {
    "role": lambda conn, reqs: conn.role,
    "supports_divergent_local_hybrid_hits": lambda conn, reqs: (
        conn.supports_divergent_local_hybrid_hits
    ),
    "requires_kv_delivery": lambda conn, reqs: conn.requires_kv_delivery,
    "may_load_async": lambda conn, reqs: [conn.may_load_async(r) for r in reqs],  # 0.34
    "get_external_cache_hit_sources": lambda conn, reqs: [
        conn.get_external_cache_hit_sources(r, 8) for r in reqs
    ],
    "has_pending_block_frees": lambda conn, reqs: conn.has_pending_block_frees(),
    "has_pending_push_work": lambda conn, reqs: conn.has_pending_push_work(),
    "take_events": lambda conn, reqs: list(conn.take_events()),
}


def _scheduler_connector(fields: dict[str, Any]) -> Any:
    """The scheduler-side connector vLLM's factory builds for ``fields``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.helpers.vllm_factories import make_kv_cache_config

    return KVConnectorFactory.create_connector(
        config=_vllm_config(fields),
        role=KVConnectorRole.SCHEDULER,
        kv_cache_config=make_kv_cache_config(block_size=16, num_blocks=8),
    )


def instance_question_mismatches(c: Case, names: Iterable[str] | None = None) -> list[str]:
    """``name: plain ... != wrapped ...`` for each instance question whose answers differ."""
    present = public_names()
    wanted = set(INSTANCE_QUESTIONS) if names is None else set(names)
    plain, wrapped = _scheduler_connector(c.plain), _scheduler_connector(c.wrapped)
    found = []
    try:
        for name, ask in INSTANCE_QUESTIONS.items():
            if name not in present or name not in wanted:
                continue
            want = _outcome(lambda ask=ask: ask(plain, _requests()))
            got = _outcome(lambda ask=ask: ask(wrapped, _requests()))
            if want != got:
                found.append(f"{name} ({c.name}, {c.role}): plain {want} != wrapped {got}")
    finally:
        plain.shutdown()  # MoRIIO's ZMQ sockets, NIXL's threads
        wrapped.shutdown()
    return found


# ------------------------------------------------------------------------ hooks


@dataclass
class HookCall:
    """How a hook is called, and what the recording double records for it."""

    side: str  # "scheduler" or "worker": the role the connector is built with
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def recorded(self) -> tuple[Any, ...]:
        # The double records keyword arguments as one trailing dict.
        return (*self.args, self.kwargs) if self.kwargs else self.args


class _Request:
    request_id = "r1"
    kv_transfer_params = None


class _Manager:
    block_pool = "pool"


def _output() -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput()


W, S = "worker", "scheduler"
HOOKS: dict[str, Callable[[], HookCall]] = {
    # Worker side (and the worker's questions).
    "get_mem_pool_context": lambda: HookCall(W),
    "clear_connector_metadata": lambda: HookCall(W),
    "register_kv_caches": lambda: HookCall(W, ({},)),
    "unregister_kv_caches": lambda: HookCall(W),  # 0.33
    "restore_kv_caches": lambda: HookCall(W),  # 0.33
    "set_host_xfer_buffer_ops": lambda: HookCall(W, ("op",)),
    "finish_forward": lambda: HookCall(W),
    "reset_capture_state": lambda: HookCall(W),
    "start_load_kv": lambda: HookCall(W, ("ctx",), {"scheduler_output": "so"}),
    "wait_for_layer_load": lambda: HookCall(W, ("layer.0",)),
    "save_kv_layer": lambda: HookCall(W, ("layer.0", "kv", "md"), {"extra": 1}),
    "wait_for_save": lambda: HookCall(W),
    "shutdown": lambda: HookCall(W),
    "get_kv_connector_kv_cache_events": lambda: HookCall(W),
    "get_handshake_metadata": lambda: HookCall(W),
    "get_finished_count": lambda: HookCall(W),
    # Scheduler side.
    "bind_kv_cache_manager": lambda: HookCall(S, (_Manager(),)),
    "bind_gpu_block_pool": lambda: HookCall(S, ("pool",)),
    "get_num_new_matched_tokens": lambda: HookCall(S, (_Request(), 3)),
    "get_loaded_kv_cache_group_ids": lambda: HookCall(S, (_Request(),)),
    "get_external_cache_hit_sources": lambda: HookCall(S, (_Request(), 5)),
    "update_state_after_alloc": lambda: HookCall(S, (_Request(), "blocks", 0)),
    "on_new_request": lambda: HookCall(S, (_Request(),)),
    "may_load_async": lambda: HookCall(S, (_Request(),)),  # 0.34
    "update_connector_output": lambda: HookCall(S, (_output(),)),
    "request_finished": lambda: HookCall(S, (_Request(), [1])),
    "request_finished_all_groups": lambda: HookCall(S, (_Request(), ([1],))),
    "register_finished_partial_tail": lambda: HookCall(S, (_Request(), ([1],), [])),
    "take_events": lambda: HookCall(S),
    "has_pending_block_frees": lambda: HookCall(S),
    "has_pending_push_work": lambda: HookCall(S),
    "set_xfer_handshake_metadata": lambda: HookCall(S, ({0: "m"},)),
    "set_xfer_handshake_metadata_pp_aware": lambda: HookCall(S, ({(0, 0): "m"},)),
    "reset_cache": lambda: HookCall(S),
}


def _wrapper_around_the_double(side: str, role: str) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtail_connector.facade.connector import KVTailConnector
    from tests.helpers.vllm_factories import make_kv_cache_config

    connector_role = KVConnectorRole.WORKER if side == W else KVConnectorRole.SCHEDULER
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    wrapper = KVTailConnector(_vllm_config(_wrap(_recording(role))), connector_role, kv)
    return wrapper, wrapper.inner


def hook_mismatches(role: str, names: Iterable[str] | None = None) -> list[str]:
    """For each hook, what the wrapper around the recording double did wrong:
    the call did not reach the inner connector as made, or the wrapper's answer
    is not the inner's."""
    present = public_names()
    wanted = set(HOOKS) if names is None else set(names)
    found = []
    built = {side: _wrapper_around_the_double(side, role) for side in (W, S)}
    for name, make_call in HOOKS.items():
        if name not in present or name not in wanted:
            continue
        call = make_call()
        wrapper, inner = built[call.side]
        got = _outcome(lambda w=wrapper, n=name, c=call: getattr(w, n)(*c.args, **c.kwargs))
        reached = inner.calls[-1] if inner.calls else None
        if reached != (name, call.recorded):
            found.append(f"{name} ({role}): the inner connector got {reached}, not the call")
            continue
        if present[name].answers:
            want = _outcome(lambda i=inner, n=name, c=call: getattr(i, n)(*c.args, **c.kwargs))
            if not _same(want, got):
                found.append(f"{name} ({role}): inner answered {want}, the wrapper {got}")
    return found


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    return a[0] == b[0] and (a[1] is b[1] or a[1] == b[1])


def all_mismatches() -> list[str]:
    """Every check of this module on the installed release, as one list of
    findings (empty: the wrapper answers every question as the inner connector)."""
    found = [
        f"{n.name} ({n.kind} of {n.owner}): neither forwarded (no check) nor in OWN_ANSWERS"
        for n in unclassified()
    ]
    for role in ROLES:
        for name in CASE_NAMES:
            c = case(name, role)
            found += class_question_mismatches(c)
            found += instance_question_mismatches(c)
        found += hook_mismatches(role)
    return found
