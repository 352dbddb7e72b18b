"""Per-backend adapters: what differs between the inner connectors we wrap."""
