#!/usr/bin/env bash
# `make images`: builds the three images (operator, gateway, runtime) and, with PUSH=1, pushes
# them. Where no Docker engine answers, it prints the commands instead, to copy to a machine that
# has one (docs/install.md, step 1):
#
#   make images REGISTRY=registry.example.com/llm TAG=0.1.0 PUSH=1
#
# REGISTRY defaults to ghcr.io/llmendpoints (the chart's default repositories), TAG to the
# package's version (the chart's appVersion).
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY="${REGISTRY:-ghcr.io/llmendpoints}"
TAG="${TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)}"
PUSH="${PUSH:-0}"

commands=()
for image in operator gateway runtime; do
    commands+=("docker build -f Dockerfile.$image -t $REGISTRY/$image:$TAG .")
done
if [[ "$PUSH" == 1 || "$PUSH" == true ]] || ! { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }; then
    for image in operator gateway runtime; do
        commands+=("docker push $REGISTRY/$image:$TAG")
    done
fi

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    for command in "${commands[@]}"; do
        echo "+ $command"
        $command
    done
else
    echo "# No Docker engine here: run these where one is (with BuildKit; the runtime image is vLLM's, several GB)."
    printf '%s\n' "${commands[@]}"
fi
