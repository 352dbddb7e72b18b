"""The state digest is launched from the producer hook (right after the
forward is enqueued) and at a load's completion: it must enqueue its work and
return without waiting for the GPU (no pageable host-to-device copy, which
PyTorch follows with a stream synchronize)."""

from __future__ import annotations

import pytest
import torch

from kvtail_connector.extras.ops.state_digest import StateDigester, StateLayer

pytestmark = pytest.mark.gpu


def test_digest_does_not_wait_for_queued_gpu_work() -> None:
    conv, ssm = 96, 512
    pages = torch.randint(0, 255, (8, conv + ssm), dtype=torch.uint8, device="cuda")
    digester = StateDigester([(1, [StateLayer(pages, ((0, conv), (conv, ssm)))])], shard=0)
    assert digester.implementation == "triton"
    digester.digest([[3]])  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    # The "forward": the stream busy for well over a second.
    torch.cuda._sleep(4_000_000_000)
    digester.digest([[3], [5]])
    # Still busy: digest() returned without waiting for the queued work.
    assert not stream.query(), "StateDigester.digest synchronized the stream"
    torch.cuda.synchronize()
