"""What faces vLLM: the connector class vLLM builds
(:class:`~kvtail_connector.facade.connector.KVTailConnector`: the scheduler's
hooks, over :class:`~kvtail_connector.facade.worker_hooks.WorkerHooks`, the
model runner's, over :class:`~kvtail_connector.facade.forwarding.ForwardingConnector`,
what passes through unchanged), how it is assembled (the one place the opt-in
features are wired in), the inner connector it wraps, vLLM's decisions keyed
on a connector's name, and the Prometheus export."""
