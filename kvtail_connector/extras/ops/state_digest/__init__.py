"""The state digest (``mix64-state-1``) of Mamba / linear-attention state blocks:
``reference`` (the definition), ``kernel`` (``@triton.jit`` only), ``launcher``
(:class:`StateDigester`: tables built once, one launch per call) and
``torch_path`` (where the kernel cannot run)."""

from kvtail_connector.extras.ops.state_digest.launcher import StateDigester, StateLayer
from kvtail_connector.extras.ops.state_digest.reference import STATE_ALGORITHM, as_u64, state_plane

__all__ = ["STATE_ALGORITHM", "StateDigester", "StateLayer", "as_u64", "state_plane"]
