"""What faces vLLM: the connector class vLLM builds
(:class:`~kvtail_connector.facade.connector.KVTailConnector` over
:class:`~kvtail_connector.facade.forwarding.ForwardingConnector`), how it is
assembled (the one place the opt-in features are wired in), the inner
connector it wraps, vLLM's decisions keyed on a connector's name, and the
Prometheus export."""
