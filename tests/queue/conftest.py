from __future__ import annotations

import pytest
from integration.nats_kit import running_nats


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory):
    with running_nats(tmp_path_factory.mktemp("nats")) as server:
        yield server
