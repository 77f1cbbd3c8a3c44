"""The README's environment table is generated from the code and must not drift from it."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "env_table.py"


def _env_table():
    spec = importlib.util.spec_from_file_location("env_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_matches_the_code():
    env_table = _env_table()
    current = env_table.current_readme_table()
    assert current is not None, "README.md lost its env-table markers"
    assert current == env_table.render(), (
        "README.md's configuration table differs from the code: run "
        "`.venv/bin/python scripts/env_table.py --write`"
    )


def test_every_setting_has_a_description():
    from llmendpoints_runtime.config import settings_variables

    undocumented = [name for name, text in settings_variables().items() if not text]
    assert not undocumented
