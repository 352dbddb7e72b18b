"""Digesting KV slots (``mix64-1``): ``kernel`` (``@triton.jit`` only, with ``tiles``, ``loads``
and ``mix64``), ``launcher`` (:class:`KVDigester`: validates, plans, launches), ``compiled`` (its
launch without re-binding), ``results`` (what a digest returns), ``plan`` (rows, requests, the work
buffer), ``torch_path`` (where Triton is absent) and ``reference`` (the contract, pure Python)."""
