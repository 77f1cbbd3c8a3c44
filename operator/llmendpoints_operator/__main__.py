"""`llmendpoints-operator` CLI (placeholder until the operator lands)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "llmendpoints-operator: the operator is not implemented yet; "
        "see the project's issues for its status.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
