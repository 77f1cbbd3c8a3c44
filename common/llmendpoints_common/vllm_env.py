"""How an environment variable's value becomes vLLM command-line arguments: the rules the runtime
applies at start-up (llmendpoints_runtime.config) and the operator applies before rollout
(llmendpoints_operator.engine_flags), kept here so that both read a value the same way.

- `env_name_for("--max-num-seqs")` is `MAX_NUM_SEQS`: any vLLM flag by its UPPER_SNAKE name;
- booleans are 1/0, true/false, yes/no, on/off (case-insensitive; empty is false);
- a multi-valued flag takes a JSON array or values separated by whitespace or commas;
- `SM_VLLM_<FLAG>` is the SageMaker spelling of the same flag.

Errors are ValueErrors with a message that completes "VARIABLE: ..."; callers name the variable.
"""

from __future__ import annotations

import json
import re

SAGEMAKER_PREFIX = "SM_VLLM_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def env_name_for(flag: str) -> str:
    """`--max-num-seqs` (or `max-num-seqs`, `max_num_seqs`) -> `MAX_NUM_SEQS`."""
    return flag.lstrip("-").replace("-", "_").upper()


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def list_values(value: str) -> list[str]:
    """A multi-valued flag's values: a JSON array, or values separated by whitespace or commas."""
    stripped = value.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not a valid JSON list: {exc}") from None
        if not isinstance(items, list):
            raise ValueError("must be a JSON list")
        return [item if isinstance(item, str) else json.dumps(item) for item in items]
    return [v for v in re.split(r"[\s,]+", stripped) if v]
