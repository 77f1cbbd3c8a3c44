"""vLLM flags in `spec.engine.args` and `spec.engine.env`, checked at apply time. PURE.

The runtime turns every variable of its pod into vLLM command-line arguments and lets vLLM's own
parser judge them at start-up: a flag the pinned vLLM does not know, or a value it refuses, stops
the pod -- and a pod that stops at start-up crash-loops while holding its GPUs. The operator has no
vLLM, so it reads the same knowledge from `vllm_flags.json`, a table generated from the pinned
vLLM's parser through the runtime's own mapping (scripts/vllm_flags.py; tests/contract/
test_engine_flags.py keeps it equal to the installed vLLM), and refuses such a spec before any pod
exists: InvalidSpec naming the field.

A variable reaches vLLM the way the runtime reads it (llmendpoints_runtime.config.
_collect_flag_args): a worker-vllm alias first, then a retired name, then `SM_VLLM_<FLAG>`, then the
runtime's own settings, then any flag by its UPPER_SNAKE name; anything else is an ordinary
environment variable and none of vLLM's business. An `engine.args` entry must name a flag.
Values are read with the shared rules of llmendpoints_common.vllm_env (booleans, lists) and
checked by the parser's type and choices. Values from `valueFrom` are not known here and not
checked (the runtime still checks them).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from llmendpoints_common import vllm_env

from llmendpoints_operator.spec import Endpoint, Problem, flag_env_name

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_BRACES = re.compile(r"(?s)^\s*{.*}\s*$")


@dataclass(frozen=True)
class Flag:
    """One vLLM flag as the runtime reads it from the environment."""

    flag: str  # --max-num-seqs
    kind: str  # value, list, append, store_true, bool_optional
    type: str  # int, float, str, json, human_int, human_int_or_auto, json_if_braces, ...
    optional: bool  # "None" and "" mean no value
    choices: tuple[Any, ...] | None


@dataclass(frozen=True)
class FlagTable:
    vllm: str
    sagemaker_prefix: str
    flags: Mapping[str, Flag]  # UPPER_SNAKE variable -> flag
    aliases: frozenset[str]
    retired: Mapping[str, tuple[str, str]]  # name -> (ignore|refuse, why)
    runtime_settings: frozenset[str]

    def lookup(self, variable: str) -> tuple[str, Flag | None]:
        """How the runtime reads `variable`: ("alias"|"retired"|"setting"|"other", None), or
        ("flag", the flag), or ("unknown-flag", None) for an SM_VLLM_ name of no flag."""
        if variable in self.aliases:
            return "alias", None
        if variable in self.retired:
            return "retired", None
        if variable.startswith(self.sagemaker_prefix):
            spec = self.flags.get(variable.removeprefix(self.sagemaker_prefix))
            return ("flag", spec) if spec is not None else ("unknown-flag", None)
        if variable in self.runtime_settings:
            return "setting", None
        spec = self.flags.get(variable)
        return ("flag", spec) if spec is not None else ("other", None)


@cache
def table() -> FlagTable:
    """The generated table (vllm_flags.json), read once."""
    raw = json.loads(resources.files(__package__).joinpath("vllm_flags.json").read_text())
    flags = {
        name: Flag(
            flag=f["flag"],
            kind=f["kind"],
            type=f["type"],
            optional=f["optional"],
            choices=tuple(f["choices"]) if f["choices"] is not None else None,
        )
        for name, f in raw["flags"].items()
    }
    return FlagTable(
        vllm=raw["vllm"],
        sagemaker_prefix=raw["sagemaker_prefix"],
        flags=flags,
        aliases=frozenset(raw["aliases"]),
        retired={k: (v[0], v[1]) for k, v in raw["retired"].items()},
        runtime_settings=frozenset(raw["runtime_settings"]),
    )


# --- values ------------------------------------------------------------------------------------


def human_int(value: str) -> int:
    """vLLM's human_readable_int: 4096, 32k (32,000), 32K (32,768), 1.5m."""
    match = _HUMAN_INT.fullmatch(value.strip())
    if match is None:
        return int(value)
    number, suffix = match.groups()
    if suffix.isupper():  # binary: 1K = 1024, and no decimals (vLLM's human_readable_int)
        return int(number) * 1024 ** "KMGT".index(suffix) * 1024
    return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))


def parse_value(type_name: str, value: str) -> Any:
    """The parser's type applied to one value: its result, or ValueError naming what it takes."""
    try:
        if type_name == "int":
            return int(value)
        if type_name == "float":
            return float(value)
        if type_name == "human_int":
            return human_int(value)
        if type_name == "human_int_or_auto":
            auto = value.strip() == "-1" or value.strip().lower() == "auto"
            return -1 if auto else human_int(value)
        if type_name == "json" or (type_name == "json_if_braces" and _BRACES.match(value)):
            return json.loads(value)
    except ValueError as exc:
        raise ValueError(_TAKES.get(type_name, "a valid value")) from exc
    if type_name == "json_object" and not _BRACES.match(value):
        raise ValueError(_TAKES[type_name])
    if type_name == "lower":
        return value.lower()
    return value


_TAKES = {
    "int": "an integer",
    "float": "a number",
    "human_int": "an integer such as 4096, 32k or 1M",
    "human_int_or_auto": "an integer such as 4096 or 32k, or auto",
    "json": "JSON",
    "json_if_braces": "a name, or a JSON object",
    "json_object": 'a JSON object such as {"key": value}',
}


def _one_value_problem(spec: Flag, value: str) -> str | None:
    if spec.optional and value in ("", "None"):
        return None
    try:
        converted = parse_value(spec.type, value)
    except ValueError as exc:
        return f"{spec.flag} takes {exc}, got {value!r}"
    if spec.choices is not None and converted not in spec.choices:
        shown = ", ".join(str(c) for c in spec.choices)
        return f"{spec.flag} must be one of {shown}; got {value!r}"
    return None


def value_problem(spec: Flag, value: str) -> str | None:
    """Why vLLM's parser would refuse `value` for this flag (as the runtime passes it), or None."""
    if not value.strip():
        return None  # the runtime treats an empty value as not set
    if spec.kind in ("store_true", "bool_optional"):
        try:
            vllm_env.parse_bool(value)
        except ValueError as exc:
            return f"{spec.flag}: {exc}"
        return None
    if spec.kind in ("list", "append"):
        try:
            items = vllm_env.list_values(value)
        except ValueError as exc:
            return f"{spec.flag}: {exc}"
        if not items:
            return f"{spec.flag} needs at least one value, got {value!r}"
        return next((p for item in items if (p := _one_value_problem(spec, item))), None)
    return _one_value_problem(spec, value)


# --- the spec ----------------------------------------------------------------------------------


def arg_text(value: str | int | float | bool) -> str:
    """An engine.args value as the pod's variable carries it (manifests.build_env)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _variables(ep: Endpoint) -> Iterator[tuple[str, str, str | None, bool]]:
    """(field, variable, value or None when from valueFrom, from args) of every engine setting."""
    engine = ep.spec.engine
    for flag, value in engine.args.items():
        yield f"spec.engine.args.{flag}", flag_env_name(flag), arg_text(value), True
    for index, var in enumerate(engine.env):
        yield f"spec.engine.env[{index}]", var.name, var.value, False


def _unknown_arg(flag: str, flags: FlagTable) -> str:
    names = [f.flag[2:] for f in flags.flags.values()]
    close = difflib.get_close_matches(flag.replace("_", "-"), names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"--{flag.replace('_', '-')} is not a flag of vLLM {flags.vllm}{hint}"


def _problem(field: str, variable: str, value: str | None, from_args: bool) -> Problem | None:
    flags = table()
    how, spec = flags.lookup(variable)
    if how == "retired" and flags.retired[variable][0] == "refuse":
        return Problem(field, f"{variable} is not supported by vLLM {flags.vllm}: "
                       f"{flags.retired[variable][1]}")  # fmt: skip
    if how == "unknown-flag":
        flag = variable.removeprefix(flags.sagemaker_prefix).lower().replace("_", "-")
        return Problem(f"{field}.name", f"--{flag} is not a flag of vLLM {flags.vllm}")
    if how == "other" and from_args:
        return Problem(field, _unknown_arg(field.rsplit(".", 1)[1], flags))
    if spec is None or value is None:
        return None
    why = value_problem(spec, value)
    return Problem(field if from_args else f"{field}.value", why) if why else None


def check(ep: Endpoint) -> list[Problem]:
    """Every engine setting the runtime would refuse at start-up, and two spellings of one flag
    with different values (the runtime refuses those too)."""
    problems: list[Problem] = []
    seen: dict[str, tuple[str, str]] = {}
    for field, variable, value, from_args in _variables(ep):
        problem = _problem(field, variable, value, from_args)
        if problem is not None:
            problems.append(problem)
            continue
        how, spec = table().lookup(variable)
        if how != "flag" or spec is None or value is None:
            continue
        earlier = seen.setdefault(spec.flag, (field, value))
        if earlier[1] != value:
            problems.append(Problem(field, f"sets {spec.flag} to {value!r}, but {earlier[0]} "
                                    f"sets it to {earlier[1]!r}"))  # fmt: skip
    return problems


def engine_settings(ep: Endpoint) -> dict[str, str]:
    """The vLLM flags (`--kv-cache-dtype`, ...) the spec's args and plain env values set, with
    their values: what the fit check reads beyond the spec's own fields."""
    settings: dict[str, str] = {}
    for _, variable, value, _ in _variables(ep):
        how, spec = table().lookup(variable)
        if how == "flag" and spec is not None and value is not None and value.strip():
            settings.setdefault(spec.flag, value)
    return settings
