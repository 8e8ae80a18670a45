"""Whether the outputs of a batch's items depend on each other: one check per module key and process.

Caching per item assumes that an item's output is the same whatever else is in its
batch. Modules that compare or pool across the batch break that: CLIP's
``logits_per_image`` (each image scored against every text of the batch), batch norm
that normalises with the batch's statistics, attention across the batch. Their rows,
cached from one batch and served in another, would be wrong.

So the first call of each call context (the module key, the arguments but the items, the
mode) in a process computes some of its items again in other batches (of two items, each
alone; of more, the last and the first, in that order, then two middle ones (one of
three), which no sort of the batch makes its largest: other sets, sizes and orders) and
compares their rows with the rows the call returns, cached or computed. A call of one
item is computed again (randomness shows there), and the next call of that context with
two items or more is checked in full. A context is checked again at a call in a batch
larger than any checked (a module may pool across the batch only from some size on:
where rows of it came from the cache, the whole batch is computed again), and at the
first call that computes items once :data:`SPOT_ITEMS` were computed since the last
check (a dependence that shows only with some batches, such as trimming a padded batch
to its longest item): the checks cost under 1 % of the items computed. Rows that differ
element by element beyond what floating point allows between batch sizes
(:func:`~.closeness.close`; integers exactly), or outputs whose per-item shape depends on the
batch, make the call raise :class:`DependentItemsError`; when the rows differ, the same
items are computed once more in the same batch, to tell randomness (dropout in training
mode) from dependence on the batch. In training mode a module that fails the check runs
uncached, with one warning. A check costs two forwards of one or two items.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..errors import KeyingError
from ..faults import Fault, FaultLog
from ..tree import Layout, flatten
from .call import CallArguments, mode_switched
from .closeness import Scales, close
from .draws import drawing_submodule
from .outputs import OutputPlan
from .rebinding import alike

__all__ = [
    "DependentItemsError",
    "ItemCheck",
    "check_items",
    "forget_checks",
    "is_checked",
    "mark_checked",
]

#: Call contexts (module key, arguments but the items, mode) whose items were seen to be independent here.
_checked: set[bytes] = set()
#: Items computed in a context after which its next call that computes items is checked again.
SPOT_ITEMS = 1024
_REMEDY = (
    "Caching per item would return rows computed in other batches. Cache a method whose outputs are per item "
    "(for CLIP: get_image_features and get_text_features instead of the whole model), give batch norm running "
    "statistics (track_running_stats=True, eval mode), call the module in eval mode if it holds dropout, or, if "
    "the rows differ only by floating-point noise, turn this check off with check_items=False"
)


class DependentItemsError(KeyingError):
    """The outputs of a batch's items depend on the other items of the batch: they cannot be cached per item.

    Attributes:
        random: Whether the outputs change from one computation to the next even in the
            same batch (dropout in training mode, sampling), rather than with the batch.
    """

    def __init__(self, message: str, random: bool = False) -> None:
        super().__init__(message)
        self.random = random


def _cause(error: Exception) -> str:
    """The first sentence of a refusal after its name: what was seen, without the remedies."""
    return str(error).partition(": ")[2].split(". ", 1)[0].rstrip(".")


def is_checked(context: bytes) -> bool:
    """Whether the items of calls in ``context`` (:attr:`CallArguments.context`) were checked in this process."""
    return context in _checked


def mark_checked(context: bytes) -> None:
    """Record that the items of calls in ``context`` are independent."""
    _checked.add(context)


def forget_checks() -> None:
    """Check every call context again at its next call."""
    _checked.clear()


class ItemCheck:
    """The item check of one cache: the training modes whose items passed it, and those run uncached.

    Args:
        name: The cached callable's name, for messages.
        enabled: ``check_items``.
        faults: Where a module that fails the check in training mode is reported.
    """

    def __init__(self, name: str, enabled: bool, faults: FaultLog) -> None:
        self.name, self.enabled, self.faults = name, enabled, faults
        #: Call contexts whose items passed the check: the largest batch checked, the items computed since.
        self.passed: dict[bytes, tuple[int, int]] = {}
        self.alone: set[bytes] = set()  # contexts whose single items were computed twice alike (not random)
        self.repeats: set[tuple[bytes, bytes]] = set()  # (context, item) of batches of one item repeated, checked
        self.uncached: set[bool | None] = set()  # training modes whose calls run without the cache
        self.whole = False  # the next check computes the whole batch again

    def again(self, context: bytes, batch: int, computed: int) -> bool:
        """Whether a call of a context that passed, computing ``computed`` of its ``batch`` items, is checked again."""
        largest, since = self.passed.get(context, (0, 0))  # cleared by another thread's re-key: checked again
        if batch > largest or since + computed >= SPOT_ITEMS:
            # rows from the cache in a larger batch: only the whole batch computed shows what it would pool
            self.whole = batch > largest and computed < batch
            return True
        self.passed[context] = (largest, since + computed)
        return False

    def state_kept(self, name: str, watches: tuple[Any, Any], training: bool | None) -> bool:
        """Whether a forward that just ran left the state its key covers, and the module's mode, as they were.

        ``watches`` are the module's :class:`~.versions.VersionWatch` and the :class:`~.versions.HeldValues`
        of its key (either may be ``None``). A forward that wrote state in training mode (batch norm's
        statistics) gives ``False``, and calls in training mode run uncached from then on. So does one that
        rebound what the key covers (``self.mu = x.mean(0)`` at its first call), or ran while another thread
        switched the module to the other mode: its rows are not stored.

        Raises:
            KeyingError: Naming what it wrote, outside training mode.
        """
        errors = (watch.written(name) for watch in watches if watch is not None)
        error = next((e for e in errors if e is not None), None)
        if error is None:  # state set by assignment as it ran (from its first batch): rows not stored under this key
            watch, held = watches
            moved = held is not None and (held.rebound(note=False, same=_unchanged) or held.states_written())
            switched = watch is not None and mode_switched(watch.module(), training)
            return not (moved or switched or (watch is not None and watch.changed(verify=False)))
        if not training:
            raise error
        self.uncached.add(True)
        self.faults.warn(
            Fault.TRAIN,
            f"in training mode: {_cause(error)}. Calls in training mode "
            "run without the cache; call .eval() on the module (keep_eval=True keeps it in eval mode)",
        )
        return False

    def reset(self) -> None:
        """Check again at the next call (the module key changed)."""
        for seen in (self.passed, self.alone, self.repeats, self.uncached):
            seen.clear()

    def verify(
        self,
        fn: Callable[..., Any],
        call: CallArguments,
        plan: OutputPlan,
        layout: Layout,
        rows: list[torch.Tensor],
        keys: list[bytes],
        kept: AbstractContextManager[Any],
        clear: Callable[[], None],
        moved: Callable[[], bool],
        cached: bool = False,
    ) -> bool:
        """Check, once per call context and process, that the call's items do not depend on each other.

        A call of one item can only show randomness: its item is computed again (once per
        context), and the next call of two items or more is checked in full.

        Args:
            fn: The callable, called with the caller's layout of arguments.
            call: The call, with at least two items.
            plan: Where the batch sits in each output leaf.
            layout: The layout of ``rows``.
            rows: The output leaves of the whole call, batch first, in input order.
            keys: The items' keys.
            kept: Restores the module's buffers after the check's forward.
            clear: Removes the entries of the module key (when the check fails).
            moved: Whether the state the key covers changed since the call took its key (on
                another thread): a check that fails then proves nothing, and gives ``False``.
            cached: Whether ``rows`` came from the cache, in whole or in part: a first check then
                computes the whole batch, as an uncached call would (rows cached from calls of one
                item, of an output pooled over the batch, look per item when checked item by item).

        Returns:
            ``False`` if they do in training mode: calls in training mode then run without
            the cache (dropout, batch statistics), and the caller computes this one afresh.
            A batch of one item repeated (a warm-up batch of zeros) cannot show dependence
            on the batch: passing, it is not marked, and the next batch is checked too.

        Raises:
            DependentItemsError: If they do outside training mode; the entries cached so
                far under this key are removed.
        """
        repeated = all(k == keys[0] for k in keys)
        if repeated and (call.context, keys[0]) in self.repeats:  # that item again: its check showed all it can
            return True
        if not is_checked(call.context) or call.context in self.passed:  # a first check, or one due again
            self.whole, whole = False, self.whole or (cached and not is_checked(call.context))
            try:
                if call.training and (drawing := drawing_submodule(fn)) is not None:  # whatever the rows would show
                    raise DependentItemsError(
                        f"{self.name}: its outputs are not deterministic ({drawing} draws at random), so a cached "
                        "output would replay one draw",
                        random=True,
                    )
                with kept:  # the check's forwards leave no trace in batch norm's statistics
                    check_items(self.name, fn, call, plan, layout, rows, whole)
            except DependentItemsError as exc:
                if moved():  # the rows were computed from other state than the check's
                    return False
                if call.training:
                    self.uncached.add(True)
                    self.faults.warn(
                        Fault.TRAIN,
                        f"in training mode: {_cause(exc)}. Calls in training mode run without the "
                        "cache; call .eval() on the module (a parent's .train() passes training mode down; "
                        "keep_eval=True keeps it in eval mode)",
                    )
                    return False
                clear()  # rows another process stored unchecked may be wrong too: all of the key's go
                raise
            if repeated:  # randomness shows; dependence on the batch cannot
                self.alone.add(call.context)
                if len(self.repeats) >= 1024:
                    self.repeats.clear()
                self.repeats.add((call.context, keys[0]))
                if call.context in self.passed:  # checked again: not due again before SPOT_ITEMS more
                    self.passed[call.context] = (self.passed[call.context][0], 0)
                return True
            mark_checked(call.context)
        largest = self.passed.get(call.context, (0, 0))[0]
        self.passed[call.context] = (max(largest, call.batch), 0)
        return True


def check_items(
    name: str,
    fn: Callable[..., Any],
    call: CallArguments,
    plan: OutputPlan,
    layout: Layout,
    rows: list[torch.Tensor],
    whole: bool = False,
) -> None:
    """Compute some items of ``call`` in another batch and compare them with ``rows``.

    Args:
        name: The cached callable's name, for the message.
        fn: The callable, called with the caller's layout of arguments.
        call: The call.
        plan: Where the batch sits in each output leaf.
        layout: The layout of ``rows``.
        rows: The output leaves of the whole call, batch first, in input order.
        whole: Compute the whole batch (its rows came from other, smaller batches).

    Raises:
        DependentItemsError: If the rows computed in the other batch differ.
    """
    batch = call.batch
    # Other sets, sizes and orders: the last and the first, then middle items (one to three), which no sort of
    # the batch (by length, say) makes its largest. A set that is not its own mirror (item i at j of k, its
    # mirror B - 1 - i at k - 1 - j) shows x - x.flip(0): of three or four items, one is added. From four
    # items on, the sets' sizes differ in parity: a forward that pools batches of one parity only shows.
    half = batch // 2
    if batch <= 2:
        sets = [[0]] if batch == 1 else [[1], [0]]
    else:
        middle = [half - 1, half, half + 1] if batch % 2 == 0 and batch > 4 else [half - 1, half] if batch > 3 else [1]
        sets = [[batch - 1, 0], middle, *([[0]] if batch == 3 else [[2, 1, 0]] if batch == 4 else [])]
    checks = [list(range(batch))] if whole else sets
    scales = Scales(rows)
    for positions in checks:
        _check_positions(name, fn, call, plan, layout, rows, scales, positions)


def _check_positions(
    name: str,
    fn: Callable[..., Any],
    call: CallArguments,
    plan: OutputPlan,
    layout: Layout,
    rows: list[torch.Tensor],
    scales: Scales,
    positions: list[int],
) -> None:
    """Compute the items at ``positions`` in a batch of their own and compare them with their ``rows``."""
    batch = call.batch
    args, kwargs = call.select(positions)
    try:
        with torch.no_grad():
            spec, leaves = flatten(fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - a batch of 2 computed, a batch of 1 of its items did not
        if positions != sorted(positions):  # it takes items in the batch's order only (pack_padded_sequence's)
            return _check_positions(name, fn, call, plan, layout, rows, scales, sorted(positions))
        raise DependentItemsError(
            f"{name}: items {positions} computed in a batch of {len(positions)} instead of {batch} raised "
            f"{type(exc).__name__}: {str(exc)[:200]}; its outputs depend on the batch (batch statistics?), or an "
            f"argument is declared wrongly (a per-item tensor in shared_args, a wrong batch_dims). {_REMEDY}"
        ) from None
    leaves = plan.to_items(spec, leaves)
    other = Layout.of(spec, leaves, None)
    same_shapes = [leaf.shape for leaf in other.leaves] == [leaf.shape for leaf in layout.leaves]
    short = next((t.shape[:1] for t in leaves if t.shape[:1] != (len(positions),)), None)  # not a row per item
    if other.spec_json != layout.spec_json or not same_shapes or short is not None:
        raise DependentItemsError(
            f"{name}: the shape of an item's output depends on the batch (an item gave {_shapes(layout)} in a batch "
            f"of {batch} and {_shapes(other)} in a batch of {len(positions)}"
            f"{'' if short is None else f', in {short[0] if short else 0} rows, not one per item'}). An output "
            "whose batch is not its first dimension (an LSTM's h_n and c_n put the layers first) is named in "
            f"batch_dims (batch_dims={{'output[1][0]': 1, 'output[1][1]': 1}}). {_REMEDY}"
        )
    index = torch.tensor(positions)
    for i, (leaf, stored) in enumerate(zip(leaves, layout.leaves)):
        expected = rows[i].index_select(0, index.to(rows[i].device)).to(leaf.device)
        if expected.dtype == leaf.dtype and torch.equal(expected, leaf):  # the same bits: close at any scale
            continue
        scale = scales[i]
        if not close(expected, leaf, stored.dtype, scale):
            with torch.no_grad():  # the same items in the same batch again: random, or dependent on the batch?
                again = plan.to_items(spec, flatten(fn(*args, **kwargs))[1])[i]
            if not close(leaf, again, stored.dtype, scale):
                remedy = (
                    "Call the module in eval mode (model.eval(); keep_eval=True keeps it there), or cache a "
                    "deterministic function"
                    if call.training
                    else "It samples in eval mode too: cache a deterministic function, or draw the randomness "
                    "outside the cached callable and pass it in"
                )
                raise DependentItemsError(
                    f"{name}: its outputs are not deterministic (output leaf {i} of items {positions} changed when "
                    f"the same batch was computed again: dropout in training mode, or random sampling), so a cached "
                    f"output would replay one draw. {remedy}",
                    random=True,
                )
            if torch.is_grad_enabled():  # the check computes without gradients: the call computed with them
                with torch.enable_grad():
                    graded = plan.to_items(spec, flatten(fn(*args, **kwargs))[1])[i]
                if close(expected, graded, stored.dtype, scale):
                    raise DependentItemsError(
                        f"{name}: its outputs depend on whether gradients are on (output leaf {i} of items "
                        f"{positions} changed when computed under torch.no_grad()), so a hit would return the rows "
                        "of whichever mode computed them. Call it in one mode only (always under torch.no_grad(), "
                        "say), or read torch.is_grad_enabled() outside the cached callable and pass it in"
                    )
            stale = (
                "the batch's stored rows are stale: something they depend on changed without changing the key (docs: "
                "What the key cannot see); cache_instance.clear() removes them"
            )
            raise DependentItemsError(
                f"{name}: the stored rows of a batch differ from its rows computed now (output leaf {i} of items "
                f"{positions}; the whole batch was computed at once, its stored rows came from other batches). Either "
                f"{stale}; or the outputs of a batch's items depend on the other items of the batch. {_REMEDY}"
                if len(positions) == batch  # every row came from storage: stale rows as likely as dependent ones
                else f"{name}: the outputs of a batch's items depend on the other items of the batch (output leaf {i} "
                f"of items {positions} changed when they were computed in a batch of {len(positions)} instead of "
                f"{batch}). {_REMEDY}. If its rows cannot depend on the batch, {stale}"
            )


def _shapes(layout: Layout) -> str:
    return ", ".join(str(list(leaf.shape)) for leaf in layout.leaves) or "no tensor"


def _unchanged(was: Any, now: Any) -> bool:
    """Whether a value a forward rebound is one its key encodes alike: an equal tensor rebuilt (``self.pos = ...``).

    Its rows stand under the key the call was made with; the next call takes the key again all the same.
    """
    if isinstance(was, torch.Tensor) and type(now) is type(was):
        kept = ("dtype", "shape", "device", "layout")
        try:
            same = all(getattr(was, name) == getattr(now, name) for name in kept) and was.stride() == now.stride()
            return same and (was.is_conj(), was.is_neg()) == (now.is_conj(), now.is_neg()) and torch.equal(was, now)
        except (RuntimeError, TypeError, NotImplementedError):  # a sparse or quantized one: taken as changed
            return False
    return alike(was, now)
