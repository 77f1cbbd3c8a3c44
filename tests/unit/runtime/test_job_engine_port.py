"""JobEngineAdapter implements the job API's JobEngine port: same members, same parameters,
same sync/async kind. Fails as soon as one side changes without the other."""

from __future__ import annotations

import inspect

from llmendpoints_runtime.job_engine import JobEngineAdapter
from llmendpoints_runtime.jobs.port import JobEngine


def _port_members() -> list[str]:
    return [
        name
        for name, member in vars(JobEngine).items()
        if callable(member) and not name.startswith("_")
    ]


def test_the_adapter_has_every_member_of_the_port() -> None:
    members = _port_members()
    assert "generate" in members and "check_openai_input" in members  # the scan finds them
    missing = [name for name in members if not callable(getattr(JobEngineAdapter, name, None))]
    assert missing == []


def test_parameters_and_kinds_match() -> None:
    for name in _port_members():
        port, adapter = getattr(JobEngine, name), getattr(JobEngineAdapter, name)
        port_params = list(inspect.signature(port).parameters)
        adapter_params = list(inspect.signature(adapter).parameters)
        assert adapter_params == port_params, name
        # async def in the port must be async def in the adapter; generate is an async
        # generator in the adapter and a plain method returning an AsyncIterator in the port.
        if inspect.iscoroutinefunction(port):
            assert inspect.iscoroutinefunction(adapter), name
        elif name == "generate":
            assert inspect.isasyncgenfunction(adapter), name
        else:
            assert not inspect.iscoroutinefunction(adapter), name
