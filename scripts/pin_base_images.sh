#!/usr/bin/env bash
# Pins the base images of Dockerfile.operator, Dockerfile.gateway and Dockerfile.runtime by digest: every `FROM
# image:tag[@sha256:...]` line gets the digest the registry serves for `image:tag` now. To bump a
# base image, edit its tag (or leave it, to take a rebuilt tag's new digest), run this script with
# registry access, and review the diff like code:
#
#   scripts/pin_base_images.sh            # resolves with `crane digest`, else `docker buildx imagetools`
#
# The digest is the multi-platform index's (what `docker pull image:tag` resolves), so one pin
# covers amd64 and arm64. tests/chart/test_dockerfiles.py requires the `@sha256:` form.
set -euo pipefail
cd "$(dirname "$0")/.."

resolve() {
    if command -v crane >/dev/null 2>&1; then
        crane digest "$1"
    else
        docker buildx imagetools inspect "$1" --format '{{json .Manifest.Digest}}' | tr -d '"'
    fi
}

files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=(Dockerfile.operator Dockerfile.gateway Dockerfile.runtime)
for file in "${files[@]}"; do
    # Every FROM that names a registry image (stage names have no ':'), once per image.
    for ref in $(awk '$1 == "FROM" {print $2}' "$file" | grep ':' | sed 's/@sha256:.*//' | sort -u); do
        digest="$(resolve "$ref")"
        if [[ ! "$digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
            echo "pin_base_images: $ref resolved to '$digest', not a sha256 digest" >&2
            exit 1
        fi
        python3 - "$file" "$ref" "$digest" <<'PY'
import re, sys
path, ref, digest = sys.argv[1:]
text = open(path).read()
pattern = re.compile(r"^(FROM\s+)" + re.escape(ref) + r"(@sha256:[0-9a-f]{64})?(?=\s|$)", re.M)
open(path, "w").write(pattern.sub(lambda m: f"{m[1]}{ref}@{digest}", text))
PY
        echo "$file: $ref@$digest"
    done
done
