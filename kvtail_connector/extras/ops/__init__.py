"""The digest kernels the opt-in KV verification runs: ``digest`` (attention KV,
``mix64-1``) and ``state_digest`` (Mamba / linear-attention states)."""
