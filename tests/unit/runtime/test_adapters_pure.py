"""The adapter list's parsing, the reconciler's decisions (with a fake engine), and the 404/503
rules for jobs and SageMaker payloads. The real engine is in tests/runtime/test_adapters.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from llmendpoints_common.errors import NotFoundError, ServiceUnavailableError
from llmendpoints_runtime.adapters.declared import (
    AdapterFileError,
    DeclaredAdapter,
    parse_adapters,
    retry_delay,
)
from llmendpoints_runtime.adapters.reconciler import AdapterReconciler
from llmendpoints_runtime.jobs.models import JobInput, check_model
from llmendpoints_runtime.jobs.port import ServedModels
from llmendpoints_runtime.sagemaker import map_model
from prometheus_client import CollectorRegistry
from pydantic import ValidationError


def test_the_mounted_list_parses_in_order():
    text = json.dumps(
        {
            "adapters": [
                {"name": "sql", "source": "org/sql-lora", "revision": "v2", "rank": 16},
                {"name": "legal", "source": "/models/adapters/legal"},
            ]
        }
    )
    sql, legal = parse_adapters(text)
    assert sql == DeclaredAdapter("sql", "org/sql-lora", "v2") and not sql.is_local
    assert legal.is_local and legal.describe() == "/models/adapters/legal"
    assert parse_adapters("") == ()


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ("{", "not valid JSON"),
        ("[]", '{"adapters"'),
        ('{"adapters": [{"name": "Bad_Name", "source": "x"}]}', "adapters[0].name"),
        ('{"adapters": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}', "twice"),
        ('{"adapters": [{"name": "a"}]}', "adapters[0].source"),
        ('{"adapters": [{"name": "a", "source": "x", "path": "y"}]}', "unknown field(s) path"),
    ],
)
def test_an_unusable_list_names_the_entry_and_field(document, words):
    with pytest.raises(AdapterFileError) as info:
        parse_adapters(document)
    assert words in str(info.value)


def test_retries_back_off_to_five_minutes():
    assert [retry_delay(n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert retry_delay(20) == 300.0


class FakeEngine:
    def __init__(self, fail: set[str] = frozenset()):
        self.fail = set(fail)
        self.held: dict[str, str] = {}
        self.calls: list[tuple] = []

    async def load(self, name: str, path: str, *, replace: bool) -> None:
        self.calls.append(("load", name, path, replace))
        if name in self.fail:
            raise RuntimeError(f"cannot load {name}")
        self.held[name] = path

    async def unload(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.held.pop(name, None)

    def loaded(self) -> frozenset[str]:
        return frozenset(self.held)


def local(name: str, tmp_path, *, sub: str = "") -> DeclaredAdapter:
    folder = tmp_path / (name + sub)
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text("{}")
    return DeclaredAdapter(name, str(folder))


async def settle(reconciler: AdapterReconciler, declared) -> None:
    await reconciler.sync(tuple(declared))
    while reconciler._tasks:
        await asyncio.sleep(0.01)


def sample(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_reconciler_loads_replaces_unloads_and_reports_failures(tmp_path):
    engine, registry = FakeEngine(fail={"bad"}), CollectorRegistry()
    reconciler = AdapterReconciler(engine, registry, adapters_file=None, base_names=("demo",))
    a, bad = local("a", tmp_path), local("bad", tmp_path)
    await settle(reconciler, [a, bad, DeclaredAdapter("demo", "/x")])

    assert engine.held == {"a": a.source}
    assert reconciler.statuses["a"].state == "ready" and reconciler.pending("a") is None
    assert "demo" not in reconciler.statuses  # the base model's name is never an adapter
    failed = reconciler.pending("bad")
    assert failed.state == "failed" and "cannot load bad" in failed.error
    assert 1 <= reconciler.retry_after(failed) <= 5
    assert sample(registry, "llmendpoints_adapter_ready", adapter="a") == 1
    assert sample(registry, "llmendpoints_adapter_ready", adapter="bad") == 0
    assert sample(registry, "llmendpoints_adapter_load_failures_total", adapter="bad") == 1
    message = "RuntimeError: cannot load bad"
    assert sample(registry, "llmendpoints_adapter_error_info", adapter="bad", message=message) == 1

    # Not yet time to retry: nothing happens. A changed source is loaded in place.
    a2 = local("a", tmp_path, sub="-v2")
    engine.calls.clear()
    await settle(reconciler, [a2, bad])
    assert engine.calls == [("load", "a", a2.source, True)]

    # Removed from the list: unloaded, and its series leave /metrics.
    await settle(reconciler, [a2])
    assert engine.held == {"a": a2.source} and "bad" not in reconciler.statuses
    assert sample(registry, "llmendpoints_adapter_ready", adapter="bad") is None
    assert sample(registry, "llmendpoints_adapter_load_failures_total", adapter="bad") is None
    assert (
        sample(registry, "llmendpoints_adapter_error_info", adapter="bad", message=message) is None
    )
    await settle(reconciler, [])
    assert engine.held == {} and not reconciler.has_pending


async def test_a_missing_local_path_fails_without_calling_the_engine(tmp_path):
    engine = FakeEngine()
    reconciler = AdapterReconciler(engine, CollectorRegistry(), adapters_file=None)
    await settle(reconciler, [DeclaredAdapter("gone", str(tmp_path / "nowhere"))])
    assert engine.calls == []
    assert "no adapter_config.json" in reconciler.statuses["gone"].error


SERVED = ServedModels(
    base=("demo",), adapters=("a1",), unavailable={"a2": ("adapter 'a2' is loading", 2)}
)


def test_jobs_get_404_for_unknown_models_and_503_for_loading_adapters():
    check_model(JobInput(prompt="x"), SERVED)
    check_model(JobInput(prompt="x", model="a1"), SERVED)
    with pytest.raises(ServiceUnavailableError) as loading:
        check_model(JobInput(prompt="x", model="a2"), SERVED)
    assert loading.value.status_code == 503 and loading.value.headers == {"retry-after": "2"}
    assert loading.value.param == "input.model"
    routed = JobInput(openai_route="/v1/completions", openai_input={"model": "nope", "prompt": "x"})
    with pytest.raises(NotFoundError) as unknown:
        check_model(routed, SERVED)
    assert unknown.value.status_code == 404
    assert unknown.value.param == "input.openai_input.model"
    assert "served: demo, a1" in unknown.value.message


def test_model_belongs_inside_openai_input_for_openai_jobs():
    with pytest.raises(ValidationError, match="set model inside openai_input"):
        JobInput(model="a1", openai_route="/v1/models")


def test_sagemaker_passes_declared_adapters_through_even_while_loading():
    assert map_model({"prompt": "x", "model": "a2"}, SERVED)["model"] == "a2"
    assert map_model({"prompt": "x", "model": "/opt/ml/model"}, SERVED)["model"] == "demo"
