"""What the operator's admission checks cost per spec: `spec.parse` alone vs `admission.admit`
(parse + managed variables + the cluster-admin policy), for every example, with a policy that
restricts everything. The reconcile, the status publication and the autoscaler each admit a spec,
so this is paid about three times per reconcile.

    .venv/bin/python bench/admission.py [--number 3000]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import timeit

import yaml
from llmendpoints_operator.admission import admit
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import parse

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRICT = OperatorSettings(
    allowed_images="registry.example.com/*",
    allowed_service_types="ClusterIP,LoadBalancer",
    allow_env_value_from=False,
    allow_trust_remote_code=False,
    allowed_priority_classes="inference-*",
    allowed_ingress_annotations="nginx.ingress.kubernetes.io/*",
    allowed_existing_claims="model-cache-*",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=3000, help="calls per measurement")
    args = parser.parse_args()
    print("| example | parse (us) | admit (us) | added (us) |")
    print("| --- | --- | --- | --- |")
    added = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        name, spec = doc["metadata"]["name"], doc["spec"]
        admit(name, "ns", spec, STRICT)  # warm the caches; raises if the example is refused
        runs = {
            label: min(timeit.repeat(call, number=args.number, repeat=3)) / args.number * 1e6
            for label, call in [
                ("parse", functools.partial(parse, name, "ns", spec)),
                ("admit", functools.partial(admit, name, "ns", spec, STRICT)),
            ]
        }
        added.append(runs["admit"] - runs["parse"])
        print(f"| {path.stem} | {runs['parse']:.0f} | {runs['admit']:.0f} | {added[-1]:.0f} |")
    print(f"\nmedian added per spec: {statistics.median(added):.0f} us")


if __name__ == "__main__":
    main()
