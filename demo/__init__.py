"""The P/D demo (``python -m demo`` from the repository root) and the engine harness
behind it. Not in the wheel: it is for a checkout; the Python processes it starts find
it through the PYTHONPATH ``procs.child_pythonpath`` gives them.

Two real vLLM CPU engines, each in its own process, move KV over NIXL or
MooncakeStore on loopback; the harness can poison and inspect their KV slots.

Modules, one concept each:

* ``tiny_model``: tiny random-weight models built offline (Llama, two hybrids).
* ``records``: the plain data crossing processes (engine config, results).
* ``slots``: worker-side slot maps of CPU_ATTN pages; poison/inspect functions run
  through ``LLM.collective_rpc``.
* ``server``: the engine process (an ``LLM`` serving commands over a pipe).
* ``engine``: the parent's handle on an engine process.
* ``procs``: stopping everything on exit, Ctrl-C and SIGTERM (process groups through
  ``psutil``); free ports; the one deadline-bounded wait for a service's state.
* ``mooncake``: a local ``mooncake_master``.
* ``pd``: a prefill/decode pair, connector configs (plain and wrapped), one P/D request.
* ``scenarios`` and ``report``: the demo's runs and its table; ``__main__``: the CLI.
* ``nixl_progress`` (and ``site/sitecustomize.py``): the pause in NIXL's busy progress thread.

The serving harness (``tests/serve``, ``benchmarks/bench_serve.py``), real API servers:

* ``api_server``: one ``vllm.entrypoints.openai.api_server`` process (start, kill,
  freeze, stop; ``/metrics``, ``/collective_rpc``); ``slot_rpc``: the ``slots``
  functions as a worker extension, reached over ``/collective_rpc``.
* ``serving``: prefill/decode pairs of servers (NIXL, MooncakeStore), plain or wrapped.
* ``router``: ``vllm-router`` (the P/D router users run) as a process on loopback;
  ``prefill_tap``: a pass-through between the router and a prefill server, where
  ``faults`` (hooks between the legs, fake prefill sides) act; ``workload``: OpenAI
  clients and prompts of chosen lengths; ``prom_text``: ``/metrics`` parsed
  (``prometheus_client``).
"""
