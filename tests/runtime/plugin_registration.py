"""Our vLLM plugin as vLLM finds it: through the ``vllm.general_plugins`` entry point that
pyproject.toml declares and an install of the package registers.

A virtualenv installed before the entry point existed does not have it (an editable install
records entry points when it is made). ``plugin_path()`` then returns a directory holding the
same registration -- a dist-info naming that entry point -- for the runtime's PYTHONPATH, so
vLLM's processes discover the plugin exactly as they do in the image.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GROUP = "vllm.general_plugins"


def declared() -> dict[str, str]:
    """The entry points pyproject.toml declares in vLLM's plugin group."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return dict(project.get("entry-points", {}).get(GROUP, {}))


def installed() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def plugin_path(directory: Path) -> Path | None:
    """None when the installed package registers our plugin; else a directory to put on the
    runtime's PYTHONPATH that registers it."""
    wanted = declared()
    if all(installed().get(name) == value for name, value in wanted.items()):
        return None
    info = directory / "llmendpoints_test_plugin_registration-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llmendpoints-test-plugin-registration\nVersion: 0\n"
    )
    lines = [f"[{GROUP}]", *(f"{name} = {value}" for name, value in wanted.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return directory
