"""What the runtime's vLLM plugin relies on in the installed vLLM (no engine started):

- the log records startup_report.py watches still exist, in the modules whose loggers it
  watches (an upgrade that rewords them would silently drop the compile phase);
- the call that needs vllm_plugin's fix is still there (when vLLM guards it, the fix is moot);
- pyproject.toml registers the plugin where vLLM looks for general plugins.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from llmendpoints_runtime import startup_report

REPO = Path(__file__).resolve().parents[2]


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is gone from the installed vLLM"
    return Path(spec.origin).read_text()


@pytest.mark.parametrize(
    ("logger", "prefix"),
    [(name, prefix) for name, rules in startup_report.WATCHED.items() for prefix, _ in rules],
)
def test_the_watched_records_are_still_logged_by_vllm(logger: str, prefix: str) -> None:
    assert f'"{prefix}' in _source(logger), f"{logger} no longer logs {prefix!r}"


def test_vllm_still_finalizes_every_loaded_artifact() -> None:
    source = _source("vllm.compilation.decorators")
    assert "loaded_fn._artifacts.compiled_fn.finalize_loading(" in source


def test_the_plugin_is_registered_for_vllm() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"llmendpoints": "llmendpoints_runtime.vllm_plugin:register"}
