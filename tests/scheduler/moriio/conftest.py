"""MoRIIO's scheduler side imports msgpack at module level (kvtail-connector[moriio])."""

import pytest

pytest.importorskip("msgpack", reason="MoRIIOConnector's scheduler side imports msgpack")
