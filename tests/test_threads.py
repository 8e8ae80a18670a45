"""Threads sharing one cached module: a change on one thread, calls on another.

Each race is forced at one point with a patched step, so every test runs the same
interleaving every time: a call on a second thread made while the first re-keys, a write
to the weights landing while a forward runs, a ``clear()`` while a call holds the memory
tier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchcache.module.independence as independence
from torchcache import KeyingError, torchcache
from torchcache.module.call import CallArguments


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def cached() -> Scale:
    model = torchcache()(Scale().eval())
    return model


def on_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Start ``fn`` on a thread; the list gets its result (or the exception it raised)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_call_made_while_another_thread_re_keys_waits_for_the_new_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Scale().eval())
    cache = model.cache_instance
    x = torch.randn(3, 4)
    assert torch.equal(model(x), x)  # w = 1, cached
    assert cache._disk is not None
    flush = cache._disk.flush
    seen: list[Any] = []

    def flush_then_call() -> None:  # the new key is known, the switch to it not made: a call from another thread
        if not seen:
            thread, out = on_thread(lambda: model(x))
            thread.join(timeout=0.5)  # it waits for the switch (a stale hit would come back at once)
            seen.append((thread, out))
        flush()

    with torch.no_grad():
        model.w.mul_(2)
    monkeypatch.setattr(cache._disk, "flush", flush_then_call)
    assert torch.equal(model(x), x * 2)
    thread, out = seen[0]
    thread.join(timeout=30)
    assert torch.equal(out[0], x * 2)  # not the hit of w = 1


def test_a_write_seen_while_another_thread_re_keys_is_taken_into_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    model = cached()
    cache = model.cache_instance
    x = torch.randn(3, 4)
    model(x)
    took = cache._take_key
    seen: list[Any] = []

    def take_key(frozen: bool = True) -> str:
        key = took(frozen)  # the key of w = 2
        if not seen:
            with torch.no_grad():
                model.w.mul_(3)  # written after that key was taken, before it is used
            thread, out = on_thread(lambda: model(x))  # a call that starts after the write
            thread.join(timeout=0.5)
            seen.append((thread, out))
        return key

    monkeypatch.setattr(cache, "_take_key", take_key)
    with torch.no_grad():
        model.w.mul_(2)
    assert torch.equal(model(x), x * 6)  # a write during its re-key: it takes the key again before it runs
    thread, out = seen[0]
    thread.join(timeout=30)
    assert torch.equal(out[0], x * 6)
    assert torch.equal(model(x), x * 6)  # and the entries under the key of w = 2 hold no row of w = 6


def test_a_write_from_another_thread_during_a_forward_is_refused_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    model = cached()
    cache = model.cache_instance
    x = torch.randn(3, 4)
    model(torch.randn(1, 4))  # the key is taken
    compute = CallArguments.compute

    def compute_then_write(self: CallArguments, fn: Callable[..., Any]) -> Any:
        out = compute(self, fn)
        with torch.no_grad():  # another thread's EMA step lands while this forward runs
            model.w.add_(1)
        return out

    monkeypatch.setattr(CallArguments, "compute", compute_then_write)
    with pytest.raises(KeyingError, match=r"wrote w in place.*another thread wrote it while the call ran"):
        model(x)  # the watch cannot tell whose write it was: not stored, and the message names both
    assert len(cache.memory) == 1  # the first call's item only
    monkeypatch.setattr(CallArguments, "compute", compute)
    assert torch.equal(model(x), x * 2)  # the next call takes the key of w = 2


def test_a_forward_that_writes_its_weights_is_still_refused() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return x * 2

    model = torchcache()(Counting().eval())
    with pytest.raises(Exception, match=r"its forward wrote seen in place"):
        model(torch.randn(3, 4))


def test_an_item_check_that_fails_because_another_thread_changed_the_weights_proves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = cached()
    cache = model.cache_instance
    x = torch.randn(4, 4)
    check = independence.check_items

    def write_then_check(*args: Any, **kwargs: Any) -> None:
        with torch.no_grad():
            model.w.add_(1)  # the items are computed again with other weights than the batch was
        check(*args, **kwargs)

    monkeypatch.setattr(independence, "check_items", write_then_check)
    out = model(x)  # the first call of two items or more is checked: no DependentItemsError
    assert torch.equal(out, x)  # as computed when the call began, and not stored
    assert len(cache.memory) == 0
    monkeypatch.setattr(independence, "check_items", check)
    assert torch.equal(model(x), x * 2) and torch.equal(model(x), x * 2)
    assert cache.stats().hits == 4


def test_clear_empties_the_memory_tier_under_its_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    model = cached()
    cache = model.cache_instance
    model(torch.randn(3, 4))
    clear = cache.memory.clear
    free: list[bool] = []

    def taken_and_released() -> bool:
        taken = cache.memory.lock.acquire(blocking=False)
        if taken:
            cache.memory.lock.release()
        return taken

    def checked_clear() -> None:  # calls on other threads find and put under the lock
        thread, out = on_thread(taken_and_released)
        thread.join(timeout=30)
        free.append(out[0])
        clear()

    monkeypatch.setattr(cache.memory, "clear", checked_clear)
    cache.clear()
    assert free == [False]
    assert len(cache.memory) == 0
