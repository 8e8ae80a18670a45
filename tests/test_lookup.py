"""The one lookup over tiers: order, copies up, pending positions, tiers searched before."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from torchcache.tiers.lookup import Part, hits_of, look_up


class DictTier:
    """A tier over a dict that records what it was asked."""

    def __init__(self, entries: dict[str, int] | None = None) -> None:
        self.entries = dict(entries or {})
        self.asked: list[list[str]] = []

    def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        self.asked.append(list(keys))
        return hits_of([self.entries.get(key) for key in keys])

    def keep(self, keys: Sequence[str], values: list[int]) -> None:
        self.entries.update(zip(keys, values))


@given(
    st.lists(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 9)), min_size=1, max_size=4),
    st.lists(st.sampled_from("abcdefg"), max_size=10),
)
def test_each_key_is_served_by_the_fastest_tier_holding_it_and_copied_into_the_faster_ones(
    contents: list[dict[str, int]], keys: list[str]
) -> None:
    tiers = [DictTier(entries) for entries in contents]
    found = look_up(tiers, keys)
    served = {p: (part.tier, v) for part in found.parts for p, v in zip(part.positions, part.values)}
    for position, key in enumerate(keys):
        holders = [level for level, entries in enumerate(contents) if key in entries]
        if not holders:
            assert position in found.missing and position not in served
            continue
        level = holders[0]
        assert served[position] == (level, contents[level][key])
        assert all(tier.entries[key] == contents[level][key] for tier in tiers[:level])
    assert found.missing == sorted(found.missing)


def test_a_tier_is_asked_only_for_the_misses_of_the_faster_ones() -> None:
    fast, slow = DictTier({"a": 1}), DictTier({"b": 2, "a": 7})
    found = look_up([fast, slow], ["a", "b", "c"])
    assert found.parts == [Part(0, [0], [1]), Part(1, [1], [2])] and found.missing == [2]
    assert fast.asked == [["a", "b", "c"]] and slow.asked == [["b", "c"]]


def test_tiers_searched_by_the_caller_only_receive_copies() -> None:
    memory, disk = DictTier({"a": 1}), DictTier({"b": 2})
    found = look_up([memory, disk], ["a", "b"], pending=[1], searched=1)
    assert memory.asked == [] and disk.asked == [["b"]]
    assert found.parts == [Part(1, [1], [2])] and found.missing == []
    assert memory.entries == {"a": 1, "b": 2}


def test_nothing_pending_asks_no_tier() -> None:
    tier = DictTier({"a": 1})
    assert look_up([tier], ["a"], pending=[]) == ([], [])
    assert tier.asked == []


def test_a_tier_that_finds_nothing_leaves_the_keys_to_the_next() -> None:
    class Broken(DictTier):
        def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[int]]]:
            return []  # a tier that cannot be read reports its fault and finds nothing

    broken, disk = Broken({"a": 1}), DictTier({"a": 5})
    found = look_up([broken, disk], ["a"])
    assert found.parts == [Part(1, [0], [5])]
