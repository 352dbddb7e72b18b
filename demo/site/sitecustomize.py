"""Put on ``PYTHONPATH`` by the serving harness (demo.api_server), ahead of the
repository root that holds ``demo`` (``demo.procs.child_pythonpath``).

Python imports ``sitecustomize`` at start-up in every interpreter that sees this
folder: the API server and the engine process it spawns. It only applies the
harness's NIXL progress-thread pause when asked to (see ``nixl_progress``).
"""

from demo.nixl_progress import apply_from_env

apply_from_env()
