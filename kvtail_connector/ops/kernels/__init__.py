"""``@triton.jit`` kernels only; launchers live in ``kvtail_connector.ops``."""
