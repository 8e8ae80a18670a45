"""``torchcache info``: everything known about one module cache, its layouts and the root's budget."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..catalog.budget import root_budget, scan_root
from ..catalog.inspect import list_files, resolve_cache
from ..catalog.layouts import summarize_layouts
from ..errors import ConfigError
from ..locations import is_url
from ..policy import format_size, plural
from .commands import command_root
from .output import cache_json, print_json, table, visible, when
from .verify import stored_kind

__all__ = ["cmd_info"]


def cmd_info(args: argparse.Namespace) -> int:
    """``torchcache info``: describe one module cache and the layouts of a sample of its entries.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 0.

    Raises:
        CacheLookupError: If no module cache, or more than one, matches the target.
    """
    if is_url(args.root):
        from . import remote

        return remote.remote_info(args.root, args)
    root = command_root(args.root)
    cache = resolve_cache(root, args.target, root_given=args.root is not None)
    files = list_files(cache.directory)
    kind = cache.meta.get("kind")
    if kind is None and cache.meta_problem is not None:  # damaged metadata: what the store holds tells
        kind = stored_kind(cache.directory)
    dataset = kind == "dataset"  # its entries are samples, not output frames
    layouts = [] if dataset else summarize_layouts(cache.directory, files, args.sample)
    sampled = sum(s.entries for s in layouts)
    settings = cache.meta.get("settings")
    budget = _root_budget(cache.directory.parent)
    if args.json:
        shapes = [
            {"layout": s.description, "entries": s.entries, "item_bytes": s.layout and s.layout.nbytes} for s in layouts
        ]
        data = {**cache_json(cache), "meta": cache.meta, "sampled_entries": sampled, "layouts": shapes}
        print_json({**data, "root_budget": budget})
        return 0
    limit = cache.max_bytes
    used = f" ({cache.nbytes / limit:.1%} used)" if limit else ""
    fields = [
        ("directory", str(cache.directory)),
        ("module key", cache.key),
        ("name", cache.name),
        ("kind", str(cache.meta.get("kind", "-"))),
        *([("dataset length", str(cache.meta.get("length", "-")))] if dataset else []),
        ("created", when(cache.created)),
        ("last used", when(cache.last_used)),
        ("torchcache", cache.version or "-"),
        ("format", str(cache.meta.get("format_version", "-"))),
        ("entries", f"{cache.entries:,}"),
        ("size", f"{format_size(cache.nbytes)} ({cache.nbytes:,} bytes)"),
        ("live", f"{format_size(cache.live_bytes)} ({cache.live_bytes:,} bytes)"),
        ("reclaimable", f"{format_size(cache.reclaimable_bytes)} ({cache.reclaimable_bytes:,} bytes)"),
        ("on disk", f"{format_size(cache.disk_bytes)} ({cache.disk_bytes:,} bytes)"),
        ("size limit", "-" if limit is None else f"{format_size(limit)}{used}"),
        ("root budget", _budget_text(budget)),
        ("temporary files", str(cache.temporaries)),
        (
            "1.0 entries",
            f"{cache.legacy_entries:,}"
            + (" (read once `torchcache migrate` packs them)" if cache.legacy_entries else ""),
        ),
        ("metadata", cache.meta_problem or "ok"),
        (
            "index",
            "ok" if cache.index_damage is None else f"{cache.index_damage}; `torchcache verify --fix` rebuilds it",
        ),
    ]
    copy_of, module_key = cache.meta.get("copy_of"), cache.meta.get("module_key")
    if isinstance(copy_of, str) or cache.unsent:  # a local copy of a Redis server or a bucket
        if isinstance(module_key, str) and cache.key.startswith(f"{module_key}-"):
            fields[1] = ("module key", module_key)
        fields.insert(2, ("copy of", copy_of if isinstance(copy_of, str) else "?"))
        fields.insert(3, ("not yet sent", f"{cache.unsent:,} entries held here only" if cache.unsent else "none"))
    if isinstance(settings, dict):
        fields.append(("settings", ", ".join(f"{k}={v}" for k, v in sorted(settings.items(), key=str)) or "-"))
    width = max(len(label) for label, _ in fields)
    for label, value in fields:
        print(f"{label:<{width}}  {visible(value)}")
    if layouts:
        print(f"\nlayouts (headers of {plural(sampled, 'entry', 'entries')}):")
        rows = [
            [f"{s.entries:,}", "-" if s.layout is None else format_size(s.layout.nbytes), s.description]
            for s in layouts
        ]
        print(table(["ENTRIES", "ITEM SIZE", "LAYOUT"], rows, right=(0, 1)))
    return 0


def _root_budget(root: Path) -> dict[str, object]:
    """The budget of a cache root, where it comes from and what its module caches take, for ``info``."""
    usage = scan_root(root)
    data: dict[str, object] = {
        "root": str(root),
        "max_bytes": None,
        "source": None,
        "used_bytes": sum(c.nbytes for c in usage),
        "module_caches": len(usage),
    }
    try:
        data["max_bytes"], data["source"] = root_budget()
    except ConfigError as exc:
        data["problem"] = f"{exc}; no budget is kept"
    return data


def _budget_text(budget: dict[str, object]) -> str:
    """The ``root budget`` line of ``info``: the budget, its source, and the share of it in use."""
    caches, used, limit = budget["module_caches"], budget["used_bytes"], budget["max_bytes"]
    assert isinstance(caches, int) and isinstance(used, int)
    taken = f"{format_size(used)} used by {plural(caches, 'cache')} in {budget['root']}"
    if "problem" in budget:
        return f"none ({budget['problem']}); {taken}"
    if not isinstance(limit, int):
        return f"none ({budget['source']} is 0); {taken}"
    source = "the default; TORCHCACHE_MAX_SIZE sets it" if budget["source"] == "default" else budget["source"]
    return f"{format_size(limit)} ({source}); {taken} ({used / limit:.1%})"
