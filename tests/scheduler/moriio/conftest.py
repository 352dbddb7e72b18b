"""MoRIIO's scheduler side imports msgpack at module level (kvtail-connector[moriio])."""

from tests.helpers.importable import importable

# Not collected without msgpack (rather than skipped at import, which pytest
# cannot do for a conftest of a path named on its command line).
collect_ignore_glob = [] if importable("msgpack") else ["test_*.py"]
