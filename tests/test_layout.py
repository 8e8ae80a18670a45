"""The package's layout: imports flow one way, and long units are few and known.

The layers, from the top: the package's entry points, the command line, features by
index, the two products (the module cache and the dataset cache, which do not import each
other), the catalog of a cache root, the tiers, the settings, the stores, and the shared
core. A module may import from its own layer and the layers below it, never above.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchcache"

#: Layer of each package and of each module at the top level, lowest first.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "core",
        {
            "torchcache._buffers",
            "torchcache._cgroup",
            "torchcache._fork",
            "torchcache._gc",
            "torchcache._log",
            "torchcache._version",
            "torchcache.canonical",
            "torchcache.codec",
            "torchcache.device_digest",
            "torchcache.dtypes",
            "torchcache.errors",
            "torchcache.faults",
            "torchcache.keys",
            "torchcache.output_types",
            "torchcache.policy",
            "torchcache.stats",
            "torchcache.tree",
        },
    ),
    ("stores", {"torchcache.stores"}),
    ("settings", {"torchcache.config", "torchcache.locations", "torchcache.meta"}),
    ("tiers", {"torchcache.tiers"}),
    ("catalog", {"torchcache.catalog"}),
    ("products", {"torchcache.module", "torchcache.datasets"}),
    ("features", {"torchcache.features"}),
    ("cli", {"torchcache.cli"}),
    ("entry", {"torchcache", "torchcache.__main__"}),
]
#: Groups of one layer that must not import each other.
PEERS = {"torchcache.module", "torchcache.datasets"}
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250
#: The units over those limits, with the lines they may not pass: each is to be split, or
#: to shrink, never to grow (a new long unit fails the test until it is split).
LONG_UNITS = {
    "torchcache.codec": 660,
    "torchcache.datasets.cache.SampleCache": 295,
    "torchcache.datasets.decode": 495,
    "torchcache.module.engine": 575,
    "torchcache.module.engine.Cache": 500,
    "torchcache.stores.packed.index": 660,
    "torchcache.stores.packed.segments": 465,
    "torchcache.stores.packed.segments.SegmentFiles": 380,
    "torchcache.stores.packed.store": 470,
    "torchcache.stores.packed.store.PackedStore": 415,
    "torchcache.stores.redis.store.RedisStore": 280,
    "torchcache.stores.rows.file.RowsFile": 325,
    "torchcache.tiers.persistent.PersistentTier": 335,
}


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    """A module's source and its syntax tree, read once while this file's tests run (never changed by a test)."""
    source = path.read_text()
    return source, ast.parse(source, str(path))


@pytest.fixture(autouse=True, scope="module")
def _forget_the_trees() -> Iterator[None]:
    """The trees go once this file's tests have run (300,000 objects every later collection would walk)."""
    yield
    _parsed.cache_clear()


def module_name(path: Path) -> str:
    parts = ["torchcache", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def group_of(name: str) -> tuple[int, str]:
    """The layer's rank and the group (package or top-level module) that ``name`` belongs to."""
    best: tuple[int, str] | None = None
    for rank, (_, groups) in enumerate(LAYERS):
        for group in groups:
            if (name == group or name.startswith(group + ".")) and (best is None or len(group) > len(best[1])):
                best = (rank, group)
    if best is None:
        raise LookupError(name)
    return best


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                skipped.update(ast.walk(child))
    return skipped


def imports_of(name: str, path: Path, known: set[str], *, run_only: bool = False) -> set[str]:
    """The torchcache modules that ``name`` imports, lazily or not (with ``run_only``, not those for annotations)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = _parsed(path)[1]
    skipped = _type_checking_only(tree) if run_only else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target == "torchcache" or target.startswith("torchcache.")}


def test_every_module_has_a_layer() -> None:
    missing = []
    for name in modules():
        try:
            group_of(name)
        except LookupError:
            missing.append(name)
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_imports_flow_one_way() -> None:
    known = set(modules())
    wrong = []
    for name, path in modules().items():
        rank, group = group_of(name)
        for target in sorted(imports_of(name, path, known)):
            target_rank, target_group = group_of(target)
            upward = target_rank > rank
            across = target_group != group and {group, target_group} <= PEERS
            if upward or across:
                wrong.append(f"{name} ({LAYERS[rank][0]}) imports {target} ({LAYERS[target_rank][0]})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return circles


def test_no_import_circles() -> None:
    known = set(modules())
    graph = {
        name: {t for t in imports_of(name, path, known, run_only=True) if t in known and t != name}
        for name, path in modules().items()
    }
    assert import_circles(graph) == []


def test_the_circle_check_sees_a_circle_through_a_third_module() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_check_sees_an_import_upward(tmp_path: Path) -> None:
    path = tmp_path / "codec.py"
    path.write_text("from .cli.main import main\n\ndef f():\n    from .module import engine\n")
    found = imports_of("torchcache.codec", path, {"torchcache.module.engine", "torchcache.cli.main"})
    assert found == {"torchcache.cli.main", "torchcache.module.engine"}
    assert all(group_of(target)[0] > group_of("torchcache.codec")[0] for target in found)


def _units() -> list[tuple[str, str, int, str]]:
    units = []
    for name, path in modules().items():
        source, tree = _parsed(path)
        units.append((name, "module", source.count("\n"), ast.get_docstring(tree) or ""))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                units.append((f"{name}.{node.name}", "class", lines, ast.get_docstring(node) or ""))
    return units


@pytest.mark.parametrize(("kind", "limit"), [("module", MAX_MODULE_LINES), ("class", MAX_CLASS_LINES)])
def test_long_units_are_the_known_ones_and_do_not_grow(kind: str, limit: int) -> None:
    units = [(name, lines) for name, unit_kind, lines, _ in _units() if unit_kind == kind]
    unknown = [f"{name}: {lines} lines" for name, lines in units if lines > LONG_UNITS.get(name, limit)]
    assert not unknown, f"split each {kind} over {limit} lines (or shrink a known long one): {unknown}"


def test_the_list_of_long_units_names_only_long_units() -> None:
    sizes = {
        name: (lines, MAX_MODULE_LINES if kind == "module" else MAX_CLASS_LINES) for name, kind, lines, _ in _units()
    }
    stale = sorted(name for name in LONG_UNITS if name not in sizes or sizes[name][0] <= sizes[name][1])
    assert not stale, f"remove from LONG_UNITS what is no longer long: {stale}"
