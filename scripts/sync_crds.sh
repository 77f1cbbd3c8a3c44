#!/usr/bin/env bash
# Copies the CRDs from crds/ (the single source of truth, written with the operator) into the Helm
# chart's files/crds/ folder, byte for byte (templates/crds.yaml renders them, so that `helm
# upgrade` upgrades them). tests/chart checks that both are identical, so run this
# after every change to crds/ (or `make sync-crds`). Removes chart CRDs that no longer exist.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=crds
DST=charts/llmendpoints/files/crds
mkdir -p "$DST"
shopt -s nullglob
sources=("$SRC"/*.yaml)
(( ${#sources[@]} )) || { echo "sync_crds: no CRD in $SRC/" >&2; exit 1; }
for f in "$DST"/*.yaml; do
    [[ -e "$SRC/$(basename "$f")" ]] || { rm -- "$f"; echo "sync_crds: removed $f"; }
done
for f in "${sources[@]}"; do
    if ! cmp -s "$f" "$DST/$(basename "$f")"; then
        cp -- "$f" "$DST/"
        echo "sync_crds: $f -> $DST/"
    fi
done
