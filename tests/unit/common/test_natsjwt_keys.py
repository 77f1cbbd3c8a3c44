"""Queue keys as the chart generates them (32 random bytes in base64) or as nsc writes them."""

from __future__ import annotations

import base64

import pytest
from llmendpoints_common.queue import natsjwt


def test_a_random_key_whose_base64_starts_with_s_is_read_as_random_bytes():
    raw = bytes([0x4A]) + bytes(range(31))  # base64 "Sg...": 1 in 64 of the chart's keys
    text = base64.b64encode(raw).decode()
    assert text.startswith("S")
    key = natsjwt.load_key(text + "\n", "A", what="account")
    assert key.public == natsjwt.key_from_raw(raw, "A").public


def test_an_nkey_seed_is_read_as_one_and_a_broken_one_is_named():
    seed = natsjwt.key_from_raw(bytes(32), "A")
    again = natsjwt.load_key(seed.seed, "A", what="account")
    assert again.public == seed.public
    with pytest.raises(natsjwt.CredentialsError, match="account: not an nkey seed"):
        natsjwt.load_key("SAbroken", "A", what="account")
