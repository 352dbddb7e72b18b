"""P's tail hook is one the installed vLLM's runner calls before the step's output exists.

Under ``vouch_tails: trust`` a consumer skips the tails a producer vouched for,
so P's zeroing must be on the stream before anything can read the KV or the
claim can leave: before sampling, and so before the runner starts the output
copy that the scheduler (and through it the claim and D's transfer) waits on.
The runners cannot run here (CUDA, a model), so the order is read from their
source, for the very ``VllmConfig`` an engine would build:

- ``_compat.producer_tail_hook`` names the connector hook;
- the runner's connector adapter (``ActiveKVConnector``) says which of its
  methods call that hook;
- the runner's ``execute_model`` (the forward; ``sample_tokens`` builds the
  output after it) calls one of those methods, unconditionally, after the
  forward's last statement.

The V2 runner (0.32 and 0.33 where selected, the only runner of 0.34) calls
``wait_for_save`` from ``post_forward`` in ``sample_tokens``, after the output
copy started: a hook there is too late. The V1 runner (0.32 and 0.33) calls
``wait_for_save`` as the connector context around the forward exits.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
from vllm.config import VllmConfig

from kvtail_connector import _compat
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers.vllm_factories import make_vllm_config

# V2-family runners: (runner module, runner class, its connector adapter module).
# cpu/standalone_model_runner is 0.34's runner for CPUs other than x86; the x86
# CPU runner and the XPU runner subclass the GPU one without touching these paths.
V2_RUNNERS = [
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "vllm.v1.worker.gpu.kv_connector"),
    (
        "vllm.v1.worker.cpu.standalone_model_runner",
        "StandaloneCPUModelRunner",
        "vllm.v1.worker.cpu.kv_connector",
    ),
]


def _source_tree(module: str) -> ast.Module | None:
    """The module's syntax tree, read from its file (importing the GPU runner
    would need CUDA); None where this vLLM has no such module."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    return ast.parse(Path(spec.origin).read_text(), filename=spec.origin)


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn


def _self_kv_connector_call(node: ast.AST) -> str | None:
    """``m`` for a call ``self.kv_connector.m(...)``, else None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    owner = node.func.value
    if (
        isinstance(owner, ast.Attribute)
        and owner.attr == "kv_connector"
        and isinstance(owner.value, ast.Name)
        and owner.value.id == "self"
    ):
        return node.func.attr
    return None


def _adapter_methods_calling(adapter: ast.Module, hook: str) -> set[str]:
    """The ``ActiveKVConnector`` methods that call the connector's ``hook``."""
    (klass,) = [
        n for n in adapter.body if isinstance(n, ast.ClassDef) and n.name == "ActiveKVConnector"
    ]
    return {
        fn.name
        for fn in klass.body
        if isinstance(fn, ast.FunctionDef)
        and any(_self_kv_connector_call(n) == hook for n in ast.walk(fn))
    }


def _forward_done_line(execute_model: ast.FunctionDef) -> int:
    """The last line of the statement that runs the model (assigns ``model_output``)."""
    lines = [
        n.end_lineno or n.lineno
        for n in ast.walk(execute_model)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "model_output" for t in n.targets)
    ]
    assert lines, "execute_model no longer assigns model_output: read the runner again"
    return max(lines)


def _producer_config() -> VllmConfig:
    """A vouching producer's config, as its engine builds it."""
    extra = {"backend": "NixlConnector", "vouch_tails": "trust"}
    return make_vllm_config(**wrapper_fields(extra), kv_role="kv_producer")


def _v2_config(monkeypatch: pytest.MonkeyPatch) -> VllmConfig:
    """The producer's config an engine on the V2 runner has."""
    if hasattr(VllmConfig, "use_v2_model_runner"):
        # 0.32/0.33 choose the runner (V2 by default where Triton runs).
        monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda _self: True))
    return _producer_config()


@pytest.mark.parametrize(("runner_module", "runner", "adapter_module"), V2_RUNNERS)
def test_the_producer_hook_runs_in_execute_model_after_the_forward_on_v2_runners(
    monkeypatch: pytest.MonkeyPatch, runner_module: str, runner: str, adapter_module: str
) -> None:
    runner_tree, adapter_tree = _source_tree(runner_module), _source_tree(adapter_module)
    if runner_tree is None or adapter_tree is None:
        pytest.skip(f"this vLLM has no {runner_module}")
    hook = _compat.producer_tail_hook(_v2_config(monkeypatch))
    assert hook is not None, "no drafter here: a producer hook is expected"
    firing = _adapter_methods_calling(adapter_tree, hook)
    execute_model = _method(runner_tree, runner, "execute_model")
    forward_done = _forward_done_line(execute_model)
    # Statements of execute_model's own body run on every path past the forward.
    calls = [
        (stmt.lineno, _self_kv_connector_call(stmt.value))
        for stmt in execute_model.body
        if isinstance(stmt, ast.Expr)
    ]
    after_forward = [line for line, m in calls if m in firing and line > forward_done]
    assert after_forward, (
        f"{runner}.execute_model never calls {sorted(firing) or 'anything'} (which call "
        f"{hook}) after the forward (line {forward_done}): {hook} fires only later, after "
        "sample_tokens started the output copy"
    )


def test_on_the_v2_runner_p_zeroes_in_finish_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    # wait_for_save, the V1 runner's hook, comes through post_forward on V2,
    # which sample_tokens calls after it built the output.
    tree = _source_tree(V2_RUNNERS[0][0])
    assert tree is not None
    sample_tokens = _method(tree, "GPUModelRunner", "sample_tokens")
    assert any(_self_kv_connector_call(n) == "post_forward" for n in ast.walk(sample_tokens))
    assert _compat.producer_tail_hook(_v2_config(monkeypatch)) == "finish_forward"


def test_the_v1_runner_calls_wait_for_save_as_the_forward_context_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not hasattr(VllmConfig, "use_v2_model_runner"):
        pytest.skip("this vLLM has no V1 model runner")
    mixin = pytest.importorskip("vllm.v1.worker.kv_connector_model_runner_mixin")
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda _self: False))
    assert _compat.producer_tail_hook(_producer_config()) == "wait_for_save"
    # The mixin's context manager calls it once the body (the forward) is done.
    source = inspect.getsource(mixin.KVConnectorModelRunnerMixin._get_kv_connector_output)
    body = source[source.index("yield") :]
    assert "wait_for_save()" in body
    # The V1 runner runs the forward inside that context, in execute_model.
    tree = _source_tree("vllm.v1.worker.gpu_model_runner")
    assert tree is not None
    execute_model = _method(tree, "GPUModelRunner", "execute_model")
    contexts = [
        n
        for n in ast.walk(execute_model)
        if isinstance(n, ast.With)
        and any("maybe_get_kv_connector_output" in ast.unparse(i.context_expr) for i in n.items)
    ]
    assert any("_model_forward(" in ast.unparse(stmt) for ctx in contexts for stmt in ctx.body), (
        "the V1 runner no longer runs the forward inside the connector context"
    )
