"""Digesting KV slots (``mix64-1``): ``kernel`` (``@triton.jit`` only), ``launcher``
(:class:`KVDigester`: validates, plans, launches; its results), ``plan`` (rows, requests, the work
buffer), ``torch_path`` (where Triton is absent) and ``reference`` (the contract, pure Python)."""
