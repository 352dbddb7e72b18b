"""Zeroing KV slots: ``kernel`` (``@triton.jit`` only), ``launcher`` (compile once, launch
cheaply), ``plan`` (the work buffer and row table, laid out by ``work_schema``), ``zeroer``
(:class:`KVZeroer`: validates, encodes, launches; the worker's work encoded ahead) and
``functional`` (``zero_kv_blocks``), ``torch_path`` (where Triton is absent) and
``reference`` (the contract, pure torch)."""
