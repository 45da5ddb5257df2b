"""``agent_gym.untrusted``: the one reader of JSON that came from outside the process."""

from __future__ import annotations

import pytest

from agent_gym.untrusted import UntrustedJSONError, check_depth, finite, loads


@pytest.mark.parametrize(("text", "reason"), [
    ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    ("[" * 65 + "]" * 65, "nested deeper"),
    ('{"x": NaN}', "non-finite"),
    ("[-Infinity]", "non-finite"),
    ("[1e999]", "too large to be finite"),
    ("[" + "7" * 5000 + "]", "refuses"),  # int() converts at most 4,300 digits
    (b"\xff\xfe[\x001\x00]\x00", "not UTF-8"),  # UTF-16, which json.loads would guess
    ('{"x": ', "not valid JSON"),
])
def test_what_is_refused_and_why(text: str | bytes, reason: str) -> None:
    with pytest.raises(UntrustedJSONError, match=reason):
        loads(text)


def test_ordinary_json_reads_as_json() -> None:
    assert loads('{"a": [1, 2.5e3, "\\ud800", null, true]}') == {
        "a": [1, 2500.0, "\ud800", None, True]}
    assert loads(b'{"depth": [[[]]]}', max_depth=4) == {"depth": [[[]]]}


def test_a_parsed_value_too_deep_for_a_recursive_walker_is_refused() -> None:
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(UntrustedJSONError, match="nested deeper"):
        check_depth(deep)


def test_finite_names_the_setting() -> None:
    assert finite(3, "x") == 3.0
    for bad in (float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="reward"):
            finite(bad, "reward")
