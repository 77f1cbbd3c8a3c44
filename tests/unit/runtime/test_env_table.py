"""The settings tables of the three components are generated from their settings classes and
must not drift from them (README.md for the runtime, docs/operator.md, docs/gateway.md)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "env_table.py"


def _env_table():
    spec = importlib.util.spec_from_file_location("env_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("component", ["runtime", "operator", "gateway"])
def test_document_table_matches_the_code(component):
    env_table = _env_table()
    current = env_table.current_table(component)
    path = env_table.TABLES[component][0].name
    assert current is not None, f"{path} lost its settings-table markers"
    assert current == env_table.TABLES[component][3](), (
        f"{path}'s settings table differs from the code: run "
        "`.venv/bin/python scripts/env_table.py --write`"
    )


def test_every_setting_has_a_description():
    from llmendpoints_common.settings_doc import setting_rows
    from llmendpoints_gateway.config import GatewaySettings
    from llmendpoints_operator.config import OperatorSettings
    from llmendpoints_runtime.config import RuntimeSettings, settings_variables

    undocumented = [name for name, text in settings_variables().items() if not text]
    for model in (RuntimeSettings, OperatorSettings, GatewaySettings):
        undocumented += [name for name, _, meaning in setting_rows(model) if not meaning]
    assert not undocumented


def test_the_operator_table_has_what_scale_to_zero_needs():
    """The settings the chart sets for scale to zero were documented nowhere (issue 22)."""
    table = _env_table().render_operator()
    for variable in (
        "LLMEP_OPERATOR_JOBS_QUEUE_URL",
        "LLMEP_OPERATOR_GATEWAY_URL",
        "LLMEP_OPERATOR_JOBS_QUEUE_REPLICAS",
    ):
        assert f"| `{variable}` |" in table
