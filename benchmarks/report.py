"""Write ``benchmarks/RESULTS.md`` from the JSON files the benchmarks leave in ``benchmarks/results/``.

Usage::

    python benchmarks/report.py [--results DIR] [--out PATH]

RESULTS.md is the current table, never edited by hand: one section per benchmark with
its figures (median and min-max where the JSON holds several runs), the targets it is
held to (met / not met, where the JSON holds what they need), the command that made the
figures, its date, machine and versions. A benchmark's older figures live in the git
history of its JSON file. Targets are in ``TARGETS`` below, one place to change them;
a benchmark without a renderer here gets a flat table of its numbers. The module runs
past 450 lines because it holds one short renderer per benchmark, kept side by side.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# What each benchmark measures, in the order of RESULTS.md.
ABOUT = {
    "compare": "this torchcache against torchcache 0.6.0 on the same workloads W1-W6 (memory hits, disk hits, "
    "miss path, bytes on disk, plain-torch floor); see README.md for the workloads",
    "keys_and_versions": "keying a ViT-B-sized module: wrap time, the key check before every call against "
    "a W1 hit, one verify_weights check, modules holding huge attributes, the item check of a first call",
    "read_floor": "the least a checked, content-keyed read of 1,024 disk hits costs in Python (numpy, lmdb, "
    "xxhash; no torchcache code)",
    "disk_tier": "the persistent tier through the public API at 200,000 (768,) items: fill, bytes, open, "
    "1,024 random hits",
    "object_store": "a CachedDataset of 3x64x64 uint8 images in a bucket on a local S3 server (moto, its own "
    "process): warm, then serve it without the dataset on a fresh machine, against a local disk cache served "
    "the same way (both with the page cache warm; RAM tier off); features extracted into the bucket and opened on "
    "a fresh machine",
    "packed_store": "the packed disk store through its own API: fill, bytes, open, batch reads against a memmap",
    "memory_rss": "the memory tier: resident memory growth against what stats() reports, for 1 GB of entries",
    "memory_bounds": "resident memory growth under a 50 MB budget with the cyclic collector off: outputs of "
    "changing width, wide outputs, a CachedDataset read by 2 DataLoader workers (bound: budget + 10 % + 50 MB)",
    "brotli_quality": "size, encode and decode cost per brotli quality on ReLU, GELU and bf16 outputs",
    "codec_speed": "size, encode and decode cost of each frame codec (raw, zero elision, brotli, auto)",
    "dataset_cache": "CachedDataset epochs against stocaching and a preloaded floor",
    "redis_store": "the Redis store, the packed store and the Redis store behind a local copy: fill and "
    "batches of hits",
    "linear_probe": "extract_features against a hand-written np.memmap of the same features and the uncached "
    "backbone: first epoch, later epochs, a second process",
    "probe_training": "later epochs of a linear probe's training loop (a linear head's step each batch) over "
    "`features.loader` against a hand-written batched np.memmap gather of the same features, heads checked equal",
    "side_by_side": "two commits side by side (the working tree against `--base`): dataset_cache, disk_tier, "
    "linear_probe and compare run on both in turns, on one machine at one time",
    "gpu": "a torchvision ResNet-50 at 224 px, batch 256, on CUDA, fp32 and bf16 autocast: keying, hits from the "
    "host and device memory tiers and from disk in a fresh process, a first pass, against the plain forward "
    "(needs a CUDA device; not yet measured where this table lacks it)",
}

# name: (threshold, "min" (figure >= threshold) or "max" (figure <= threshold))
TARGETS = {
    "W1 hits at least 5.5x faster than 0.6.0": (5.5, "min"),
    "W1 hits within 1.5x of the W6 floor": (1.5, "max"),
    "W2 hits within 1.5x of the W6 floor": (1.5, "max"),
    "W2 hits within 1.5x of 0.6.0": (1.5, "max"),
    "W3 (768,) warm disk hits at least 5x faster than 0.6.0": (5.0, "min"),
    "W3 (197,768) warm disk hits at least as fast as 0.6.0": (1.0, "max"),
    "W3 (197,768) cold disk hits at least as fast as 0.6.0": (1.0, "max"),
    "W3 (197,768) warm hits within 1.3x of brotli's decode over the cores": (1.3, "max"),
    "W4a miss path per item at least 5x lower than 0.6.0": (5.0, "min"),
    "W4b first pass with a backbone within 1.15x of uncached": (1.15, "max"),
    "W5 ReLU f32 at the default at most 0.6x raw": (0.6, "max"),
    "W5 GELU f32 (dense) at most raw plus its header (1.05x raw)": (1.05, "max"),
    "disk_tier fill, incl. flush, at most 25 us per item": (25.0, "max"),
    "disk_tier bytes on disk at most 1.05x raw": (1.05, "max"),
    "disk_tier open (first call + flush) at most 0.5 s": (0.5, "max"),
    "gpu keying at most 5% of the forward": (0.05, "max"),
    "gpu host-memory hits at least 10x faster than the forward": (10.0, "min"),
    "gpu device-memory hits at least 50x faster than the forward": (50.0, "min"),
    "gpu first pass at most 1.05x the forward": (1.05, "max"),
    "wrap + first key of a ViT-B-sized module at most 0.1 s": (0.1, "max"),
    "wrap + first key of a module holding a 5 M-entry dict at most 3 s": (3.0, "max"),
    "disk_tier 1,024 hits within 4x of the memmap gather": (4.0, "max"),
    "disk_tier 1,024 hits within 1.3x of the read floor (same round)": (1.3, "max"),
    "disk_tier 1,024 hits within 2x of xxh3 of every input row + the memmap gather": (2.0, "max"),
    "read_floor sum within 4x of the memmap gather": (4.0, "max"),
    "packed_store fill at most 15 us per item": (15.0, "max"),
    "packed_store bytes on disk at most 1.05x raw": (1.05, "max"),
    "packed_store open + 1,024 misses at most 0.5 s": (0.5, "max"),
    "packed_store 1,024 hits within 3x of the memmap gather": (3.0, "max"),
    "linear_probe later epochs within 1.5x of the np.memmap": (1.5, "max"),
    "linear_probe first epoch (extraction) within 1.1x of uncached": (1.1, "max"),
    "linear_probe second process's first epoch within 1.5x of the np.memmap's": (1.5, "max"),
    "linear_probe first epoch (extraction) within 1.1x of uncached, every core busy with other work": (1.1, "max"),
    "linear_probe features.loader epochs within 1.5x of the batched np.memmap gather": (1.5, "max"),
    # References beside the targets, not targets: the floor a hand-written extraction sets.
    "linear_probe a hand-written extraction into an np.memmap, over uncached (reference)": (None, "reference"),
    "linear_probe the same, every core busy with other work (reference)": (None, "reference"),
    "probe_training later epochs of a training loop within 1.2x of the batched np.memmap gather": (1.2, "max"),
    "object_store first epoch from the bucket within 2x of a local disk cache's": (2.0, "max"),
    "object_store later epochs from the bucket within 1.1x of a local disk cache's": (1.1, "max"),
    "object_store half a local copy: at least 0.45 of the hits local in epochs 2-4": (0.45, "min"),
}

# compare.py's targets: (name in TARGETS, numerator (side, key), denominator or None, label);
# side "raw" takes the key from either side (W5's raw item size).
COMPARE_RATIOS: list[tuple[str, tuple[str, str], tuple[str, str] | None, str]] = [
    ("W1 hits at least 5.5x faster than 0.6.0", ("old", "W1/hit"), ("new", "W1/hit"), "0.6.0 / new"),
    ("W1 hits within 1.5x of the W6 floor", ("new", "W1/hit"), ("ref", "W6/W1"), "new / floor"),
    ("W2 hits within 1.5x of the W6 floor", ("new", "W2/hit"), ("ref", "W6/W2"), "new / floor"),
    ("W2 hits within 1.5x of 0.6.0", ("new", "W2/hit"), ("old", "W2/hit"), "new / 0.6.0"),
    (
        "W3 (768,) warm disk hits at least 5x faster than 0.6.0",
        ("old", "W3/feat768/warm"),
        ("new", "W3/feat768/warm"),
        "0.6.0 / new",
    ),
    (
        "W3 (197,768) warm disk hits at least as fast as 0.6.0",
        ("new", "W3/tok197/warm"),
        ("old", "W3/tok197/warm"),
        "new / 0.6.0",
    ),
    (
        "W3 (197,768) cold disk hits at least as fast as 0.6.0",
        ("new", "W3/tok197/cold"),
        ("old", "W3/tok197/cold"),
        "new / 0.6.0",
    ),
    (
        "W3 (197,768) warm hits within 1.3x of brotli's decode over the cores",
        ("new", "W3/tok197/warm"),
        ("ref", "W3/tok197/brotli"),
        "new / brotli decode",
    ),
    (
        "W4a miss path per item at least 5x lower than 0.6.0",
        ("old", "W4a/miss_cost"),
        ("new", "W4a/miss_cost"),
        "0.6.0 / new, us/item",
    ),
    ("W4b first pass with a backbone within 1.15x of uncached", ("new", "W4b/ratio"), None, "first / uncached"),
    (
        "W5 ReLU f32 at the default at most 0.6x raw",
        ("new", "W5/relu_f32/default"),
        ("raw", "W5/relu_f32/raw"),
        "B/item / raw",
    ),
    (
        "W5 GELU f32 (dense) at most raw plus its header (1.05x raw)",
        ("new", "W5/gelu_f32/default"),
        ("raw", "W5/gelu_f32/raw"),
        "B/item / raw",
    ),
]


def fmt(x: float) -> str:
    """About three significant digits."""
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3
    return f"{x:.{digits}f}"


def spread(values: list[float]) -> str:
    """Median, and min-max when there are several values."""
    text = fmt(statistics.median(values))
    return text + (f" [{fmt(min(values))}-{fmt(max(values))}]" if len(values) > 1 else "")


def table(rows: list[list[str]]) -> list[str]:
    """A markdown table; the first row is the header."""
    out = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    return out + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:]]


Check = tuple[str, float | None, str]


def target_rows(checks: list[Check]) -> list[list[str]]:
    """Rows of (target, measured, verdict) for checks of (name in TARGETS, figure or None, how it was measured)."""
    rows = [["target", "measured", "verdict"]]
    for name, value, shown in checks:
        limit, kind = TARGETS[name]
        if value is None:
            rows.append([name, shown or "not in this run", "not measured"])
            continue
        if limit is None:  # a reference measured beside the targets
            rows.append([name, shown, kind])
            continue
        met = value >= limit if kind == "min" else value <= limit
        rows.append([name, shown, "met" if met else "**not met**"])
    return rows


def judged(rec: dict[str, Any], checks_of: Callable[[dict[str, Any]], list[Check]]) -> list[Check]:
    """The target checks of ``rec``'s run or, where it has repeats (``repeat.py``), of the median of the runs.

    A repeated check shows the median, then every run's figure in the order they ran; a
    size label (``10,000: ...``) is kept.
    """
    repeats = rec.get("repeats") or []
    if len(repeats) < 2:
        return checks_of(rec["results"])
    each = [checks_of(run["results"]) for run in repeats]
    out: list[Check] = []
    for i, (name, _, shown) in enumerate(each[-1]):
        values = [c[i][1] for c in each if len(c) > i and c[i][0] == name and c[i][1] is not None]
        head, sep, _ = shown.partition(": ")
        label = f"{head}: " if sep and head.replace(",", "").isdigit() else ""
        if not values:
            out.append((name, None, shown))
            continue
        unit = re.match(r"[\d.,]+(x| us| ms| s)?", shown[len(label) :])
        suffix = unit.group(1) or "" if unit else ""
        middle = statistics.median(values)
        runs = ", ".join(fmt(v) + suffix for v in values)
        out.append((name, middle, f"{label}median {fmt(middle)}{suffix} of {len(values)} runs ({runs})"))
    return out


def sized(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-size records of a benchmark's results (``{"10000": {"items": 10000, ...}, ...}``)."""
    return [x for x in r.values() if isinstance(x, dict) and "items" in x]


def judged_section(
    rec: dict[str, Any], head: str, rows: list[list[str]], checks_of: Callable[[dict[str, Any]], list[Check]]
) -> list[str]:
    """A section's text: its description, the runs behind it, its figures, and its targets (:func:`judged`)."""
    checks = judged(rec, checks_of)
    return [head, "", *repeats_line(rec), *table(rows), "", *table(target_rows(checks)), ""]


def repeats_line(rec: dict[str, Any]) -> list[str]:
    """What the runs behind a repeated benchmark's targets were (none: nothing)."""
    repeats = rec.get("repeats") or []
    if len(repeats) < 2:
        return []
    runs = "; ".join(
        f"{run['date'][11:16]} ({run['seconds']:.0f} s, load {run.get('load_average', {}).get('before') or 0:.2f}, "
        f"commit {run['versions']['commit']})"
        for run in repeats
    )
    return [
        f"Targets are judged on the median of {len(repeats)} runs (`python benchmarks/repeat.py {rec['benchmark']} "
        f"--runs {len(repeats)}`, one process after another; the tables show the last): {runs}.",
        "",
    ]


def provenance(rec: dict[str, Any]) -> list[str]:
    """The command, date, duration, load, machine and versions of one JSON file."""
    m, v, load = rec["machine"], rec["versions"], rec.get("load_average", {})
    loads = " -> ".join(f"{x:.2f}" for x in (load.get("before"), load.get("after")) if x is not None)
    return [
        f"`{rec['command']}` on {rec['date'][:16].replace('T', ' ')} UTC, {rec['seconds']:.0f} s, "
        f"load average {loads or '?'}; {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; "
        f"python {v['python']}, torch {v['torch']}, numpy {v['numpy']}, torchcache {v['torchcache']} "
        f"(commit {v['commit']})",
        "",
    ]


def pooled(res: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """compare.py's worker records: values per side and key, repeats of several processes pooled."""
    recs: dict[str, dict[str, list[float]]] = {"new": {}, "old": {}, "ref": {}}
    for worker in res["workers"]:
        for r in worker["records"]:
            recs[worker["side"]].setdefault(r["key"], []).extend(r["values"])
    return recs


def render_compare(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    res = rec["results"]
    recs = pooled(res)

    def med(side: str, key: str) -> float | None:
        values = recs["new"].get(key) or recs["old"].get(key) if side == "raw" else recs[side].get(key)
        return statistics.median(values) if values else None

    def per_round(side: str, key: str) -> list[float]:
        """The median of ``key`` in each process of ``side``, in the order they ran."""
        out = []
        for worker in res["workers"]:
            values = [v for r in worker["records"] if r["key"] == key for v in r["values"]]
            if worker["side"] == side and values:
                out.append(statistics.median(values))
        return out

    checks: list[tuple[str, float | None, str]] = []
    for name, (side, key), below, label in COMPARE_RATIOS:
        a, b = med(side, key), med(*below) if below else 1.0
        rounds = (
            [x / y for x, y in zip(per_round(side, key), per_round(*below))]
            if below and side != "raw" and below[0] != "raw"
            else []
        )
        if a is None or not b:
            checks.append((name, None, ""))
        elif name.startswith("W3 (197,768)") and "0.6.0" in name and len(rounds) > 1:  # judged in every round
            shown = ", ".join(f"{r:.2f}" for r in rounds)
            checks.append((name, max(rounds), f"{label} per round: {shown}x (median {a / b:.2f}x)"))
        elif below is None:  # a ratio of its own: show its spread
            checks.append((name, a, f"{label}: {spread(recs[side][key])}x"))
        else:
            checks.append((name, a / b, f"{label}: {fmt(a)} / {fmt(b)} = {a / b:.2f}x"))
    lines = [
        "Times in ms per batch unless the unit says otherwise; median [min-max] over the repeats of every "
        "process; `new/floor` relates the new median to the W6 floor (W1, W2), the raw-read reference (W3), "
        "the raw file writes of the same process (W4a) or the raw bytes (W5).",
        "",
        *table(res["table"]),
        "",
    ]
    if not any(key.endswith("/cold") for key in recs["new"]):
        lines += ["Cold page-cache rows need root (`/proc/sys/vm/drop_caches`); this run could not drop caches.", ""]
    disturbed = [f"{w['side']} {w['task']}" for w in res["workers"] if w.get("other_cpu", 0) > 0.3]
    if disturbed:
        lines += [
            f"Other processes kept more than 0.3 cores busy during {len(disturbed)} of "
            f"{len(res['workers'])} tasks ({', '.join(sorted(set(disturbed)))}).",
            "",
        ]
    lines += [f"Correctness checks failed: {res.get('checks_failed', '?')}.", ""]
    note = (
        "W5 counts every file of the packed store for 512 items, its LMDB index and lock file included "
        "(a part mostly fixed, about 200 bytes per item at this size), against targets set for one file per item."
    )
    w2, w2_old, w2_floor = med("new", "W2/hit"), med("old", "W2/hit"), med("ref", "W6/W2")
    if w2 and w2_old and w2_floor:
        note += (
            f" W2 hits take {w2 / w2_old:.2f}x 0.6.0's time ({fmt(w2)} against {fmt(w2_old)} ms) and "
            f"{w2 / w2_floor:.2f}x the W6 floor ({fmt(w2_floor)} ms). A sound hit hashes every byte of the 64 inputs "
            "of (197,768) float32 (39 MB a batch) with xxh3 and gathers 39 MB of outputs; a new 39 MB tensor costs "
            "the kernel fresh pages at every call (about 12 ms here), so the gather goes into the buffer of an "
            "earlier batch once nothing refers to it, as the floor's does. 0.6.0 keys an item by a weighted sum of "
            "a subsample of its elements (it reads a fraction of the bytes, and can return another input's output) "
            "and writes hits into one buffer it keeps, handing it out again at the next call."
        )
    return [*lines, *table(target_rows(checks)), "", note, ""]


def render_keys(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]

    def cell(figure: dict[str, float]) -> str:
        return f"{fmt(figure['median'])} [{fmt(figure['min'])}-{fmt(figure['max'])}]"

    rows = [
        ["figure", "median [min-max]", "runs"],
        ["wrap + first module key", cell(r["wrap_s"]) + " s", str(r["wrap_s"]["runs"])],
        [
            "key check before each call"
            + (f" ({r['check_bindings']} values watched)" if "check_bindings" in r else ""),
            cell(r["check_us"]) + " us",
            str(r["check_us"]["runs"]),
        ],
        ["W1 memory-hit batch (256 x 3x64x64)", cell(r["w1_hit_ms"]) + " ms", str(r["w1_hit_ms"]["runs"])],
        ["check / W1 hit batch (medians)", f"{r['check_share_of_w1_hit']:.2%}", ""],
        ["one verify_weights check", cell(r["verify_ms"]) + " ms", str(r["verify_ms"]["runs"])],
    ]
    if "dict_5m_wrap_s" in r:
        rows += [
            ["wrap + first key, a 5 M-entry dict attribute", cell(r["dict_5m_wrap_s"]) + " s", "3"],
            ["wrap + first key, a list of 2 M small objects", cell(r["objects_2m_wrap_s"]) + " s", "3"],
            ["first call, 16 x 3x224x224, items checked", cell(r["first_call_checked_s"]) + " s", "3"],
            ["first call, 16 x 3x224x224, check_items=False", cell(r["first_call_unchecked_s"]) + " s", "3"],
            ["the item check's share of a first call (medians)", f"+{r['check_share_of_first_call']:.1%}", ""],
        ]
    checks = [
        ("wrap + first key of a ViT-B-sized module at most 0.1 s", r["wrap_s"]["median"], cell(r["wrap_s"]) + " s"),
    ]
    if "dict_5m_wrap_s" in r:
        figure = r["dict_5m_wrap_s"]
        checks.append(
            ("wrap + first key of a module holding a 5 M-entry dict at most 3 s", figure["median"], cell(figure) + " s")
        )
    rows_targets = table(target_rows(checks))
    return [
        f"{r['model']}; outputs checked: {'correct' if r['correct'] else '**WRONG**'}.",
        "",
        *table(rows),
        "",
        *rows_targets,
        "",
    ]


def render_read_floor(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    runs, memmap = r.get("runs_ms", {}), r["memmap"]
    rows = [["step", "ms per 1,024 hits, median [min-max]", "x memmap"]]
    for key, label in (
        ("memmap", "memmap gather (the reference)"),
        ("key", "key: xxh3-128 per row and item"),
        ("lookup_get", "look up: txn.get loop"),
        ("lookup_getmulti", "look up: Cursor.getmulti"),
        ("check", "check: header + xxh3-64 each"),
        ("copy", "copy: payloads joined"),
    ):
        rows.append([label, spread(runs[key]) if key in runs else fmt(r[key]), f"{r[key] / memmap:.1f}"])
    rows.append(["sum (faster look-up)", fmt(r["sum_ms"]), f"{r['sum_ms'] / memmap:.1f}"])
    checks = [("read_floor sum within 4x of the memmap gather", r["sum_ms"] / memmap, f"{r['sum_ms'] / memmap:.1f}x")]
    head = f"{r['items']:,} rows of (768,) float32, 20 random batches of 1,024; every copied batch checked."
    return [head, "", *table(rows), "", *table(target_rows(checks)), ""]


def render_disk_tier(rec: dict[str, Any], every: dict[str, Any]) -> list[str]:
    r = rec["results"]

    def figure(key: str, scale: float = 1.0) -> str:
        values = r.get(f"{key}_rounds")
        return spread([x * scale for x in values]) if values else fmt(r[key] * scale)

    rows = [
        ["figure", "median of the rounds [min-max]"],
        ["fill, incl. flush, us/item", figure("fill_us")],
        ["bytes on disk / raw", figure("disk_ratio")],
        ["open: first call + flush, fresh process, ms", figure("open_s", 1e3)],
        ["1,024 random hits, fresh process, ms", figure("hit_ms")],
        ["memmap gather of the same rows, ms", figure("memmap_ms")],
        ["read floor in the same round (read_floor.py's steps), ms", figure("floor_ms") if "floor_ms" in r else "-"],
        ["hits / read floor", figure("floor_ratio") if "floor_ratio" in r else "-"],
        [
            "xxh3 of every input row + the gather, same process, ms",
            figure("hash_gather_ms") if "hash_gather_ms" in r else "-",
        ],
        ["hits / (xxh3 + gather)", figure("hash_gather_ratio") if "hash_gather_ratio" in r else "-"],
    ]
    head = (
        f"{r['items']:,} items of (768,) float32, `max_memory_cache_size=0`, {r.get('rounds', 1)} rounds, each "
        "with a new cache; every hit checked against its row."
    )
    return judged_section(rec, head, rows, _disk_tier_checks)


def _disk_tier_checks(r: dict[str, Any]) -> list[Check]:
    def figure(key: str) -> str:
        values = r.get(f"{key}_rounds")
        return spread(values) if values else fmt(r[key])

    return [
        ("disk_tier fill, incl. flush, at most 25 us per item", r["fill_us"], f"{r['fill_us']:.1f} us"),
        ("disk_tier bytes on disk at most 1.05x raw", r["disk_ratio"], f"{r['disk_ratio']:.3f}x"),
        ("disk_tier open (first call + flush) at most 0.5 s", r["open_s"], f"{fmt(r['open_s'])} s"),
        ("disk_tier 1,024 hits within 4x of the memmap gather", r["hit_ratio"], f"{r['hit_ratio']:.1f}x"),
        (
            "disk_tier 1,024 hits within 1.3x of the read floor (same round)",
            r.get("floor_ratio"),
            f"{r['floor_ratio']:.2f}x (rounds {figure('floor_ratio')})" if "floor_ratio" in r else "",
        ),
        (
            "disk_tier 1,024 hits within 2x of xxh3 of every input row + the memmap gather",
            r.get("hash_gather_ratio"),
            f"{r['hash_gather_ratio']:.2f}x" if "hash_gather_ratio" in r else "",
        ),
    ]


def render_packed(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    batch = spread(r["batch_runs_ms"]) if "batch_runs_ms" in r else fmt(r["batch_ms"])
    floor = spread(r["floor_runs_ms"]) if "floor_runs_ms" in r else fmt(r["floor_ms"])
    rows = [
        ["figure", "value"],
        ["fill: put_many of 1,024, then flush", f"{r['fill_us']:.2f} us/item"],
        ["bytes on disk / raw", f"{r['disk_ratio']:.4f}x"],
        ["open + get_many of 1,024 misses, fresh process", f"{r['open_s'] * 1e3:.0f} ms"],
        ["get_many of 1,024 random hits, fresh process, ms median [min-max]", batch],
        ["np.memmap gather of the same rows, ms", floor],
    ]
    if r.get("lmdb_values"):
        x = r["lmdb_values"]
        rows.append(
            [
                "values in LMDB alone: fill, disk/raw, batch",
                f"{x['fill_us']:.2f} us, {x['disk_ratio']:.3f}x, {x['batch_ms_same_process']:.2f} ms",
            ]
        )
    checks = [
        ("packed_store fill at most 15 us per item", r["fill_us"], f"{r['fill_us']:.2f} us"),
        ("packed_store bytes on disk at most 1.05x raw", r["disk_ratio"], f"{r['disk_ratio']:.4f}x"),
        ("packed_store open + 1,024 misses at most 0.5 s", r["open_s"], f"{r['open_s'] * 1e3:.0f} ms"),
        ("packed_store 1,024 hits within 3x of the memmap gather", r["batch_ratio"], f"{r['batch_ratio']:.2f}x"),
    ]
    head = f"{r['entries']:,} entries of 3,072 bytes; reads checked: {'correct' if r['correct'] else '**WRONG**'}."
    return [head, "", *table(rows), "", *table(target_rows(checks)), ""]


def render_memory(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    rows = [["items", "entries", "stats() bytes", "RSS growth", "RSS / stats", "hits equal outputs"]]
    for x in r["rows"]:
        rows.append(
            [
                x["shape"],
                f"{x['entries']:,}",
                f"{x['stats_bytes']:,}",
                f"{x['rss_growth']:,}",
                f"{x['rss_over_stats']:.3f}",
                "yes" if x["correct"] else "**NO**",
            ]
        )
    return [f"About {r['gb']} GB of entries per case.", "", *table(rows), ""]


def render_brotli(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    rows = [["items", "output", "quality", "size / raw", "encode us/item", "decode us/item"]]
    last = ("", "")
    for x in r["rows"]:
        now = (x["shape"], x["output"])
        shown = [now[0] if now[0] != last[0] else "", now[1] if now != last else ""]
        last = now
        rows.append([*shown, x["quality"], f"{x['size_ratio']:.3f}", f"{x['encode_us']:.0f}", f"{x['decode_us']:.0f}"])
    head = (
        f"brotli {r['brotli']}; a frame stays raw unless brotli shrinks it below {r['raw_ratio']:.0%}; "
        f"single thread; decode failures: {r['failures']}."
    )
    return [head, "", *table(rows), ""]


def render_codec(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    rows = [["output", "mode", "stored as", "size / raw", "encode us/item", "decode us/item", "decode MB/s"]]
    for x in r["rows"]:
        rows.append(
            [
                x["output"],
                x["mode"],
                x["codec"],
                f"{x['size_ratio']:.3f}",
                f"{x['encode_us']:.0f}",
                f"{x['decode_us']:.0f}",
                f"{x['decode_mb_s']:.0f}",
            ]
        )
    return [f"{r['items']} items per output, single thread; every frame round trip checked.", "", *table(rows), ""]


def render_dataset(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    f = r["figures"]
    unc = f["uncached_s"]
    rows = [["cached", "library", "first epoch s", "first / uncached", "later epochs s, median [min-max]", "speedup"]]
    for key, x in f.items():
        if not isinstance(x, dict) or "later_s" not in x:
            continue
        lib, frac = key.rsplit("_", 1)
        rows.append(
            [
                f"{float(frac):.0%}",
                lib,
                f"{x['first_s']:.2f}",
                f"{x['first_s'] / unc:.2f}x",
                spread(x["later_all_s"]),
                f"{unc / x['later_s']:.2f}x",
            ]
        )
    for name in ("uncached", "floor"):
        rows.append(["", name, "", "", spread(r["epochs"][name]), f"{unc / f[name + '_s']:.2f}x"])
    verdicts = [["target", "measured", "verdict"]]
    for t in r["targets"]:
        verdicts.append(
            [t["target"], t["measured"], "not measured" if t["met"] is None else "met" if t["met"] else "**not met**"]
        )
    head = f"{r['items']:,} images, {r['rounds']} rounds; wrong samples: {r['wrong']}."
    return [head, "", *table(rows), "", *table(verdicts), ""]


def render_redis(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    rows = [["store", "fill us/item", "hits ms/batch, median [min-max]", "round trips/batch", "correct"]]
    for name, x in r.items():
        if not isinstance(x, dict):
            continue
        rows.append(
            [
                name,
                "-" if name == "new copy" else f"{x['fill_us_per_item']:.1f}",
                f"{x['batch_ms_median']:.2f} [{x['batch_ms_min']:.2f}-{x['batch_ms_max']:.2f}]",
                "-" if name == "packed" else f"{x['round_trips_per_batch']:.0f}",
                str(bool(x["correct"])),
            ]
        )
    head = f"{r['entries']:,} entries of {r['value_bytes']:,} bytes, random batches of {r['batch']:,} hits."
    return [head, "", *table(rows), ""]


def render_linear_probe(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    sizes = sized(r)
    rows = [
        [
            "samples",
            "uncached s",
            "extraction s",
            "extraction + read epoch s",
            "hand-written extraction s",
            "memmap epoch s",
            "features epoch s",
            "batched gather epoch s",
            "features.loader epoch s",
            "second process s",
            "changed dataset s",
        ]
    ]
    for x in sizes:
        later = x["later_epochs_s"]
        rows.append(
            [
                f"{x['items']:,}",
                spread(x["uncached_epochs_s"]),
                spread(x["extracts_s"]),
                spread(x["first_epochs_s"]),
                spread(x["hand_extracts_s"]) if "hand_extracts_s" in x else "not measured",
                spread(later["memmap"]),
                spread(later["features"]),
                spread(later["gather"]) if "gather" in later else "not measured",
                f"{spread(later['loader'])} ({x['loader_over_gather']:.2f}x)" if "loader" in later else "not measured",
                f"{spread(x['second_process_first_epochs_s'])} (open {fmt(x['second_process_open_s'])}"
                + (
                    f"; a memmap's {spread(x['second_process_memmap_epochs_s'])})"
                    if "second_process_memmap_epochs_s" in x
                    else ")"
                ),
                f"{fmt(x['changed_extract_s'])} ({x['changed_over_extract']:.2f}x extraction; backbone on "
                f"{x['changed_backbone_samples']:,} of {x['changed_items']:,})",
            ]
        )
    wrong = sum(not x["correct"] for x in sizes)
    head = (
        f"Features of (512,) float32, DataLoader batch 256, {sizes[0]['workers'] if sizes else 0} workers; "
        f"times in seconds, median [min-max]; sizes with a wrong sample: {wrong}."
    )
    return judged_section(rec, head, rows, _linear_probe_checks)


def _linear_probe_checks(r: dict[str, Any]) -> list[Check]:
    checks: list[Check] = []
    for x in sized(r):
        n = f"{x['items']:,}"
        checks += [
            (
                "linear_probe later epochs within 1.5x of the np.memmap",
                x["later_over_memmap"],
                f"{n}: {x['later_over_memmap']:.2f}x",
            ),
            (
                "linear_probe first epoch (extraction) within 1.1x of uncached",
                x["extract_over_uncached"],
                f"{n}: {x['extract_over_uncached']:.2f}x; with one read epoch {x['first_over_uncached']:.2f}x",
            ),
            (
                "linear_probe second process's first epoch within 1.5x of the np.memmap's",
                x["second_over_memmap"],
                f"{n}: {x['second_over_memmap']:.2f}x, backbone calls {x['second_process_backbone_calls']}",
            ),
        ]
        if x.get("busy_extract_over_uncached") is not None:
            checks.append(
                (
                    "linear_probe first epoch (extraction) within 1.1x of uncached, every core busy with other work",
                    x["busy_extract_over_uncached"],
                    f"{n}: {x['busy_extract_over_uncached']:.2f}x with {x['busy_processes']} spinning processes "
                    f"(uncached {spread(x['busy_uncached_epochs_s'])} s, extraction {spread(x['busy_extracts_s'])} s)",
                )
            )
        if "loader_over_gather" in x:
            checks.append(
                (
                    "linear_probe features.loader epochs within 1.5x of the batched np.memmap gather",
                    x["loader_over_gather"],
                    f"{n}: {x['loader_over_gather']:.2f}x",
                )
            )
        for key, name in (
            ("hand_extract_over_uncached", "linear_probe a hand-written extraction into an np.memmap, over uncached"),
            ("busy_hand_extract_over_uncached", "linear_probe the same, every core busy with other work"),
        ):
            if x.get(key) is not None:
                checks.append((f"{name} (reference)", x[key], f"{n}: {x[key]:.2f}x"))
    return checks


def render_probe_training(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    sizes = sized(r)
    rows = [["samples", "batched gather epoch, ms", "features.loader epoch, ms", "loader / gather, median of rounds"]]
    for x in sizes:
        rows.append(
            [
                f"{x['items']:,}",
                spread([t * 1e3 for t in x["gather_epochs_s"]]),
                spread([t * 1e3 for t in x["loader_epochs_s"]]),
                f"{spread(x['ratios'])}x",
            ]
        )
    wrong = sum(not x["correct"] for x in sizes)
    head = (
        f"Features of (512,) float32, batch 256, {sizes[0]['epochs'] if sizes else 0} rounds of one epoch each, "
        f"a linear head trained every epoch; sizes with a check failed (labels, trained heads): {wrong}."
    )
    return judged_section(rec, head, rows, _probe_training_checks)


def _probe_training_checks(r: dict[str, Any]) -> list[Check]:
    return [
        (
            "probe_training later epochs of a training loop within 1.2x of the batched np.memmap gather",
            x["loader_over_gather"],
            f"{x['items']:,}: {x['loader_over_gather']:.2f}x",
        )
        for x in sized(r)
    ]


def render_gpu(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    rows = [["figure (ms per batch, median [min-max])", *(p for p in ("fp32", "bf16_autocast") if p in r)]]
    for key, label in (
        ("a_forward", "a: plain forward"),
        ("b_keying", "b: keying alone"),
        ("c_host_memory_hit", "c: all hits, host memory tier"),
        ("d_device_memory_hit", "d: all hits, device memory tier"),
        ("e_disk_hit_fresh_process", "e: all hits from disk, fresh process"),
        ("f_first_pass", "f: first pass, all misses, persistent"),
    ):
        rows.append([label, *(_ms(r[p][key]) for p in ("fp32", "bf16_autocast") if p in r)])
    checks = []
    for p in ("fp32", "bf16_autocast"):
        if p in r:
            x = r[p]["ratios"]
            checks += [
                ("gpu keying at most 5% of the forward", x["b_keying_over_a"], f"{p}: {x['b_keying_over_a']:.1%}"),
                (
                    "gpu host-memory hits at least 10x faster than the forward",
                    x["a_over_c"],
                    f"{p}: {x['a_over_c']:.1f}x",
                ),
                (
                    "gpu device-memory hits at least 50x faster than the forward",
                    x["a_over_d"],
                    f"{p}: {x['a_over_d']:.1f}x",
                ),
                ("gpu first pass at most 1.05x the forward", x["f_over_a"], f"{p}: {x['f_over_a']:.2f}x"),
            ]
    correct = all(r[p]["correct"] for p in ("fp32", "bf16_autocast") if p in r)
    head = f"{r['device']}, torch {r['torch']}, {r['model']}, batch {r['batch']}; outputs checked: "
    return [head + ("correct." if correct else "**WRONG**."), "", *table(rows), "", *table(target_rows(checks)), ""]


def _ms(figure: dict[str, float]) -> str:
    return f"{fmt(figure['median_ms'])} [{fmt(figure['min_ms'])}-{fmt(figure['max_ms'])}]"


def render_flat(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    """Any other benchmark: its top-level numbers."""
    res = rec["results"]
    rows = [["figure", "value"]] + [[k, fmt(v)] for k, v in res.items() if isinstance(v, (int, float))]
    return [*table(rows), ""]


def render_object_store(rec: dict[str, Any], every: dict[str, Any]) -> list[str]:
    """The flat figures, the half-copy orders side by side, and the targets."""
    res = rec["results"]
    out = render_flat(rec, every)
    halves = [("shuffle", "a plain shuffle", "64 MiB"), ("window", "WindowSampler", "64 MiB")]
    halves += [("shuffle_small_stash", "a plain shuffle", "16 MiB"), ("window_small_stash", "WindowSampler", "16 MiB")]
    rows = [["order", "stash", "local share of hits, epochs 1-4", "MB read from the bucket", "seconds"]]
    for name, order, stash in halves:
        if f"half_copy_{name}_received_mb" in res:
            rows.append([order, stash, ", ".join(fmt(x) for x in res[f"half_copy_{name}_hit_rates"]),
                         ", ".join(fmt(x) for x in res[f"half_copy_{name}_received_mb"]),
                         ", ".join(fmt(x) for x in res[f"half_copy_{name}_epochs_s"])])  # fmt: skip
    if len(rows) > 1:
        out += [f"A local copy of half the cache ({fmt(res['payload_mb'])} MB of samples), four epochs each:", ""]
        out += [*table(rows), ""]
    rates = res.get("half_local_copy_hit_rates_epochs_1_to_4", [])
    checks: list[tuple[str, float | None, str]] = [
        ("object_store first epoch from the bucket within 2x of a local disk cache's", res["first_epoch_ratio"],
         f"{fmt(res['first_epoch_ratio'])}x (the server's floor: {fmt(res['raw_download_over_local_epoch_1_stream'])}x "
         "to download the segments on 1 stream, nothing decoded)"),
        ("object_store later epochs from the bucket within 1.1x of a local disk cache's", res["second_epoch_ratio"],
         f"{fmt(res['second_epoch_ratio'])}x"),
        ("object_store half a local copy: at least 0.45 of the hits local in epochs 2-4", min(rates[1:] or [0.0]),
         ", ".join(fmt(x) for x in rates[1:])),
    ]  # fmt: skip
    return [*out, *table(target_rows(checks)), ""]


def render_side_by_side(rec: dict[str, Any], _: dict[str, Any]) -> list[str]:
    r = rec["results"]
    rows = [["benchmark", "figure", f"base {r['base']}", f"head {r['head']}", "head/base"]]
    for name, figures in r["table"].items():
        for label, row in figures.items():
            rows.append([name, label, fmt(row["base"]), fmt(row["head"]), f"{row['head_over_base']:.2f}x"])
    sizes = "the benchmarks' quick sizes" if r["quick"] else "the benchmarks' full sizes"
    head = (
        f"Medians over {r['pairs']} turns, each running every benchmark on both commits ({sizes}), the side "
        "that goes first alternating; lower is faster. Each benchmark checked its own results on both sides."
    )
    return [head, "", *table(rows), ""]


RENDER: dict[str, Callable[[dict[str, Any], dict[str, Any]], list[str]]] = {
    "side_by_side": render_side_by_side,
    "object_store": render_object_store,
    "gpu": render_gpu,
    "linear_probe": render_linear_probe,
    "probe_training": render_probe_training,
    "compare": render_compare,
    "keys_and_versions": render_keys,
    "read_floor": render_read_floor,
    "disk_tier": render_disk_tier,
    "packed_store": render_packed,
    "memory_rss": render_memory,
    "brotli_quality": render_brotli,
    "codec_speed": render_codec,
    "dataset_cache": render_dataset,
    "redis_store": render_redis,
}


def report(every: dict[str, dict[str, Any]]) -> str:
    """The text of RESULTS.md for the loaded JSON files (name -> record)."""
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by hand. "
        "To refresh a section, run its benchmark (each writes `benchmarks/results/<name>.json`, see "
        "`benchmarks/README.md`), then `python benchmarks/report.py`. Earlier figures are in the git history "
        "of the JSON files.",
        "",
        "What each benchmark measures:",
        "",
    ]
    names = [n for n in ABOUT if n in every] + sorted(n for n in every if n not in ABOUT)
    lines += [f"- `{n}.py`: {ABOUT.get(n, 'see its docstring')}" for n in ABOUT]
    missing = [n for n in ABOUT if n not in every]
    if missing:
        lines += ["", "Not in this table (no JSON file yet): " + ", ".join(f"`{n}.py`" for n in missing) + "."]
    machines = {
        f"{r['machine']['cpu']}, {r['machine']['cores']} cores, {r['machine']['ram_gib']} GiB" for r in every.values()
    }
    lines += [
        "",
        f"Machines: {'; '.join(sorted(machines))}. Each section names its command, date, load average before "
        "and after, machine and versions. These machines may be shared with other work: the figures are noisy "
        "(read the min-max spreads and the load averages), and a target at the edge can flip between runs.",
        "",
    ]
    for name in names:
        rec = every[name]
        lines += [f"## {name}", "", *provenance(rec), *RENDER.get(name, render_flat)(rec, every)]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results", help="folder of the JSON files")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    every = {}
    for path in sorted(args.results.glob("*.json")):
        rec = json.loads(path.read_text())
        if "results" not in rec or "command" not in rec:
            print(f"skipped {path}: not written by benchmarks/_meta.py", file=sys.stderr)
            continue
        every[rec.get("benchmark", path.stem)] = rec
    for name, rec in every.items():  # repeat.py's runs: the targets are judged on their median
        runs = sorted((args.results / "runs").glob(f"{name}-*.json"), key=lambda p: int(p.stem.rpartition("-")[2]))
        rec["repeats"] = [json.loads(run.read_text()) for run in runs]
    if not every:
        print(f"no results in {args.results}: run the benchmarks first", file=sys.stderr)
        return 1
    args.out.write_text(report(every))
    print(f"wrote {args.out} from {len(every)} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
