"""How much of the engine one request asks for, and the bound on it (pure; no engine here).

vLLM runs every sequence of a request as an engine request of its own: ``n: 4`` is four, a
``/v1/completions`` with a list of three prompts is three, and both together twelve. So the
admission in front of the engine counts sequences, not requests (``runtime/admission.py``),
and ``MAX_N`` bounds ``n`` and ``best_of`` wherever a request or a job can set them. vLLM 0.32's
chat and completion routes no longer use ``best_of`` (it is ignored there), but a client may
still send it, and older servers ran ``best_of`` sequences for it: it is bounded and counted too.

Values are read as vLLM's pydantic models read them (lax: ``"16"`` and ``16.0`` are 16), so a
number cannot slip past the bound by being spelled as a string.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from llmendpoints_common.errors import BadRequestError

DEFAULT_MAX_N = 16
SEQUENCE_FIELDS = ("n", "best_of")
# The routes whose body says how many sequences they generate.
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CHAT_BATCH = "/v1/chat/completions/batch"
SEQUENCE_ROUTES = frozenset({COMPLETIONS, CHAT, CHAT_BATCH})


def lax_int(value: Any) -> int | None:
    """``value`` as pydantic's lax mode turns it into an int, or None if it would not."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                return None
            return int(number) if math.isfinite(number) and number.is_integer() else None
    return None


def check_max_n(params: Mapping[str, Any], max_n: int, *, prefix: str = "") -> int:
    """Refuse ``n`` or ``best_of`` above ``max_n`` (400 naming ``prefix + name``); return the
    sequences one prompt asks for: max(n, best_of), 1 when neither is set. Values that are not
    numbers count 1 here: vLLM (or the job checks) refuses them with their own message."""
    count = 1
    for name in SEQUENCE_FIELDS:
        value = lax_int(params.get(name))
        if value is None:
            continue
        if value > max_n:
            field = prefix + name
            raise BadRequestError(
                f"{field}: at most {max_n} sequences per request (MAX_N), got {value}; "
                "send several requests instead",
                param=field,
            )
        count = max(count, value)
    return count


def prompt_count(route: str, body: Mapping[str, Any]) -> int:
    """How many prompts a body carries: a list of prompts on /v1/completions, a list of
    conversations on /v1/chat/completions/batch, else one."""
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        # A list of strings or of token-id lists is several prompts; a flat list of token
        # ids is one.
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int | float):
            return len(prompt)
    elif route == CHAT_BATCH:
        messages = body.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[0], list):
            return len(messages)
    return 1


def request_sequences(route: str, body: Mapping[str, Any], max_n: int, *, prefix: str = "") -> int:
    """The sequences a request runs (n x prompts), after the ``MAX_N`` check (``prefix``
    roots the field a 400 names). Routes that generate nothing count 1."""
    if route not in SEQUENCE_ROUTES:
        return 1
    return check_max_n(body, max_n, prefix=prefix) * prompt_count(route, body)


_PROMPT_LIST = re.compile(rb'"prompt"\s*:\s*\[\s*[^\s\d-]')
_CONVERSATION_LIST = re.compile(rb'"messages"\s*:\s*\[\s*\[')


def may_ask_for_more_than_one(route: str, body: bytes) -> bool:
    """False when a raw JSON body certainly asks for one sequence: it names no ``n`` or
    ``best_of``, has no list of prompts, and no ``\\u`` escape (which could spell a key).
    Lets the hot path skip parsing the body a second time (pure)."""
    if route not in SEQUENCE_ROUTES:
        return False
    if b'"n"' in body or b'"best_of"' in body or b"\\u" in body:
        return True
    if route == COMPLETIONS:
        return _PROMPT_LIST.search(body) is not None
    if route == CHAT_BATCH:
        return _CONVERSATION_LIST.search(body) is not None
    return False
