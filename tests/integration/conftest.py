"""Fixtures of the integration tests: one emulated cluster and one real operator per module.

A module sets OPERATOR_ENV (LLMEP_OPERATOR_* settings) to configure its operator. One of each per
module, not per test: the emulator slows down as requests pile up, and an operator takes a
second or two to start.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from ports import free_port

from .kube_emulator import Cluster, Operator


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster() as cluster:
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def operator(
    cluster: Cluster, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Operator]:
    tmp = tmp_path_factory.mktemp("operator")
    operator = Operator(
        cluster.write_kubeconfig(tmp / "kubeconfig"),
        tmp / "operator.log",
        env=getattr(request.module, "OPERATOR_ENV", {}),
        metrics_port=free_port(),
    )
    await operator.start()
    yield operator
    await operator.stop()
