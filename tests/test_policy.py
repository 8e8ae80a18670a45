"""Size parsing and formatting, and the eviction orders."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.errors import ConfigError
from torchcache.policy import MAX_SIZE, LruPolicy, MruPolicy, format_size, parse_size

# -- parse_size -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1, 1),
        (123_456_789, 123_456_789),
        (1e9, 1_000_000_000),
        (2.5e3, 2500),
        (10.9, 10),
        ("0", 0),
        ("42", 42),
        ("42B", 42),
        ("2GB", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("2 GB", 2 * 10**9),
        ("  2GB  ", 2 * 10**9),
        ("500MiB", 500 * 2**20),
        ("500mib", 500 * 2**20),
        ("1.5 kB", 1500),
        ("1.5KB", 1500),
        ("1.5KiB", 1536),
        (".5MB", 500_000),
        ("3TB", 3 * 10**12),
        ("2TiB", 2 * 2**40),
        ("1GiB", 2**30),
        ("7K", 7000),
        ("7M", 7 * 10**6),
        ("7G", 7 * 10**9),
        ("1e9", 10**9),
        ("1E3KB", 10**6),
        ("2.5e-3GB", 2_500_000),
    ],
)
def test_parse_size(value: Any, expected: int) -> None:
    result = parse_size(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2.01kB", 2010), ("4.35MB", 4_350_000), ("2.03GB", 2_030_000_000), ("1.1KiB", 1126), ("0.29kB", 290)],
)
def test_parse_size_decimal_strings_are_exact(value: str, expected: int) -> None:
    assert parse_size(value) == expected


_DECIMAL_UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 3), st.sampled_from(sorted(_DECIMAL_UNITS)))
def test_parse_size_rounds_the_exact_value_down(digits: int, decimals: int, unit: str) -> None:
    text = f"{Decimal(digits).scaleb(-decimals):f}{unit}"
    expected = int(Decimal(digits).scaleb(-decimals) * _DECIMAL_UNITS[unit])
    assert parse_size(text) == expected, text


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**63))
def test_parse_size_returns_ints_unchanged(value: int) -> None:
    assert parse_size(value) == value
    assert parse_size(str(value)) == value


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        -1,
        -0.5,
        "-1GB",
        True,
        False,
        "5XB",
        "",
        "GB",
        "1.2.3MB",
        "2 G B",
        float("nan"),
        float("inf"),
        "inf",
        None,
    ],
)
def test_parse_size_errors_name_the_argument(value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, "max_memory_cache_size")
    assert isinstance(info.value, ValueError)
    assert "max_memory_cache_size" in str(info.value)


@pytest.mark.parametrize("value", [[1], {"a": 1}, b"1GB", object()])
def test_parse_size_rejects_other_types(value: Any) -> None:
    with pytest.raises(ConfigError, match="budget"):
        parse_size(value, "budget")


# -- format_size ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (999, "999 B"),
        (1000, "1.0 kB"),
        (1536, "1.5 kB"),
        (2.5e6, "2.5 MB"),
        (2.5e9, "2.5 GB"),
        (3e12, "3.0 TB"),
        (4e15, "4000.0 TB"),
    ],
)
def test_format_size(num_bytes: float, expected: str) -> None:
    assert format_size(num_bytes) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**15))
def test_format_size_parses_back_within_rounding(num_bytes: int) -> None:
    text = format_size(num_bytes)
    parsed = parse_size(text)
    assert abs(parsed - num_bytes) <= max(1, 0.05 * num_bytes), text


# -- policies -------------------------------------------------------------------------------


def _drain(policy: MruPolicy[str]) -> list[str]:
    out = []
    while len(policy):
        out.append(policy.victim())
    return out


def test_mru_evicts_most_recent_first() -> None:
    policy = MruPolicy[str]()
    for key in "abcd":
        policy.add(key)
    assert list(policy) == ["a", "b", "c", "d"]
    assert _drain(policy) == ["d", "c", "b", "a"]


def test_lru_evicts_least_recent_first() -> None:
    policy = LruPolicy[str]()
    for key in "abcd":
        policy.add(key)
    assert _drain(policy) == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("cls", "expected"), [(MruPolicy, ["b", "d", "c", "a"]), (LruPolicy, ["a", "c", "d", "b"])])
def test_touch_reorders(cls: type[MruPolicy[str]], expected: list[str]) -> None:
    policy = cls()
    for key in "abcd":
        policy.add(key)
    policy.touch("b")
    assert list(policy) == ["a", "c", "d", "b"]
    policy.touch("zzz")  # unknown keys are ignored
    assert "zzz" not in policy
    assert len(policy) == 4
    assert _drain(policy) == expected


@pytest.mark.parametrize("cls", [MruPolicy, LruPolicy])
def test_add_existing_key_makes_it_most_recent(cls: type[MruPolicy[str]]) -> None:
    policy = cls()
    for key in "abca":
        policy.add(key)
    assert len(policy) == 3
    assert list(policy) == ["b", "c", "a"]


@pytest.mark.parametrize("cls", [MruPolicy, LruPolicy])
def test_discard_and_clear(cls: type[MruPolicy[str]]) -> None:
    policy = cls()
    for key in "abc":
        policy.add(key)
    policy.discard("b")
    policy.discard("missing")
    assert "b" not in policy and "a" in policy
    assert list(policy) == ["a", "c"]
    policy.clear()
    assert len(policy) == 0
    assert list(policy) == []


@pytest.mark.parametrize("cls", [MruPolicy, LruPolicy])
def test_victim_on_empty_raises_key_error(cls: type[MruPolicy[str]]) -> None:
    policy = cls()
    with pytest.raises(KeyError):
        policy.victim()
    policy.add("a")
    assert policy.victim() == "a"
    with pytest.raises(KeyError):
        policy.victim()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["add", "touch", "discard", "victim"]), st.integers(0, 5)), max_size=40),
    st.booleans(),
)
def test_policies_match_a_list_model(ops: list[tuple[str, int]], recent_first: bool) -> None:
    policy: MruPolicy[int] = MruPolicy() if recent_first else LruPolicy()
    model: list[int] = []  # least to most recently used
    for op, key in ops:
        if op == "add":
            if key in model:
                model.remove(key)
            model.append(key)
            policy.add(key)
        elif op == "touch":
            if key in model:
                model.remove(key)
                model.append(key)
            policy.touch(key)
        elif op == "discard":
            if key in model:
                model.remove(key)
            policy.discard(key)
        elif model:
            assert policy.victim() == model.pop(-1 if recent_first else 0)
        else:
            with pytest.raises(KeyError):
                policy.victim()
        assert list(policy) == model
        assert len(policy) == len(model)


@pytest.mark.parametrize("value", ["1e999999999", "1e999999999GB", "9" * 400, "1e40", 10**40, 1e300, 2**64 + 1])
def test_parse_size_too_large_is_a_config_error_naming_the_argument(value: Any) -> None:
    with pytest.raises(ConfigError, match="max_persistent_cache_size must be at most"):
        parse_size(value, "max_persistent_cache_size")


def test_parse_size_largest_accepted() -> None:
    assert parse_size(MAX_SIZE) == MAX_SIZE == parse_size(f"{MAX_SIZE}B")
