"""Zeroing KV slots: ``kernel`` (``@triton.jit`` only), ``launcher`` (compile once, launch
cheaply), ``plan`` (the work buffer and row table, laid out by ``work_schema``), ``zeroer``
(:class:`KVZeroer`: validates, encodes, launches) and ``functional`` (``zero_kv_blocks``),
``_step_zeroer`` (the worker's launch paths), ``torch_path`` (where Triton is absent) and
``reference`` (the contract, pure torch)."""
