"""The opt-in features, layered on the core: producer claims (``vouch_tails``)
and KV verification (``verify_kv``), which travel from producer to consumer in
the ``kvtail`` entry (:mod:`~kvtail_connector.extras.entry`).

They plug into the core through :mod:`kvtail_connector.core.extension` (scheduler
side: :class:`~kvtail_connector.extras.scheduler.EntryFeatures`; worker side:
:class:`~kvtail_connector.extras.worker.EntryFeaturesWorker`), wired in by
:mod:`kvtail_connector.facade.assembly` alone. No core module imports this package;
without it the wrapper runs the core and refuses the settings that need it.
"""
