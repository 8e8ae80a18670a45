"""Every ``python`` block of the README and of ``docs/*.md`` runs as it is shown.

The blocks of a page run one after another in a fresh interpreter, from the repository
root, each as a ``__main__`` of its own (a fresh namespace) with ``TORCHCACHE_DIR`` in a
directory of its own. A block that cannot run as it is (it needs a checkpoint from a
hub, torchvision, a Redis server, or it is a fragment) says so in an HTML comment on the
line before its fence, with a reason: ``<!-- not run: needs a hub checkpoint -->``.
Blocks that promise hits in a later run are run twice in one cache root, and the second
run must read from the disk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, python_env, run_python

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARK = re.compile(r"^\s*<!--\s*not run\b\s*:?\s*(?P<reason>.*?)\s*-->\s*$")
_DISK_HITS = re.compile(r"disk hits[ :=]+(\d+)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown page: where it starts, its language, its code, why it is not run."""

    page: Path
    line: int
    lang: str
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def reason(self) -> str | None:
        """Why the block is not run (its comment's reason), or ``None`` to run it."""
        return self.not_run


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the reason given in a ``not run`` comment just before it.

    Raises:
        ValueError: If a ``not run`` comment gives no reason, or is not right before a ``python`` block.
    """
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        mark = _MARK.match(line)
        if mark is None:
            continue
        if not mark["reason"]:
            raise ValueError(f"{page.name}:{i + 1}: say why the block is not run: <!-- not run: REASON -->")
        after = next((text for text in lines[i + 1 :] if text.strip()), "")
        fence = _FENCE.match(after)
        if fence is None or fence["lang"] != "python":
            raise ValueError(f"{page.name}:{i + 1}: a `not run` comment goes right before a ```python block")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        start = _FENCE.match(lines[i])
        if start is None:
            i += 1
            continue
        indent, fence_text = start["indent"], start["fence"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence_text), len(lines))
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before)
        found.append(Block(page, i + 1, start["lang"], "\n".join(body) + "\n", mark and mark["reason"]))
        i = end + 1
    return found


def python_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks_of(page) if block.lang == "python"]


BLOCKS = python_blocks()
#: The pages whose first block prints the disk hits, and promises some in a second run.
TWICE = ["README.md", "docs/quickstart.md", "docs/index.md"]


def run_block(block: Block, root: Path) -> str:
    """Run a block's code in a fresh interpreter with ``TORCHCACHE_DIR=root``; return its stdout."""
    done = run_python(block.code, env=python_env(TORCHCACHE_DIR=str(root)), timeout=300)
    assert done.returncode == 0, f"{block.name} failed:\n{block.code}\n--- stderr ---\n{done.stderr[-4000:]}"
    return done.stdout


def runs_twice(block: Block) -> bool:
    """Whether the block is the first of a page in :data:`TWICE` (run twice by its own test)."""
    return any(block is next(b for b in BLOCKS if b.page == REPO / page) for page in TWICE)


_PAGE_RUNNER = """
import json, os, sys, traceback
blocks, report = json.load(open(sys.argv[1])), open(sys.argv[3], "w")
for i, (name, code) in enumerate(blocks):
    os.environ["TORCHCACHE_DIR"] = os.path.join(sys.argv[2], str(i))
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        json.dump({"failed": name, "code": code, "error": traceback.format_exc()[-4000:]}, report)
        raise SystemExit(1)
json.dump({"failed": None}, report)
"""


def _runnable(page: Path) -> list[Block]:
    return [b for b in BLOCKS if b.page == page and b.reason is None and not runs_twice(b)]


def test_the_python_blocks_of_every_page_run(tmp_path: Path) -> None:
    """Every runnable block of every page, in one interpreter (each block in a namespace and root of its own)."""
    blocks = [block for page in PAGES for block in _runnable(page)]
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps([[b.name, b.code] for b in blocks]))
    result = tmp_path / "result.json"
    done = run_python(_PAGE_RUNNER, str(listing), str(tmp_path / "roots"), str(result), timeout=900)
    report = json.loads(result.read_text()) if result.exists() else {"failed": "?", "error": done.stderr[-4000:]}
    failure = f"{report.get('failed')} failed:\n{report.get('code', '')}\n--- error ---\n{report.get('error')}"
    assert done.returncode == 0 and report["failed"] is None, failure


@pytest.mark.parametrize("page", TWICE)
def test_a_second_run_reads_the_disk(page: str, tmp_path: Path) -> None:
    block = next(b for b in BLOCKS if b.page == REPO / page)
    assert block.reason is None
    first = _DISK_HITS.findall(run_block(block, tmp_path))
    second = _DISK_HITS.findall(run_block(block, tmp_path))
    assert first == ["0"], f"{block.name}: its first run hit the disk"
    assert len(second) == 1 and int(second[0]) > 0, f"{block.name}: its second run found nothing on disk"


def test_a_second_run_reads_the_redis_server(tmp_path: Path) -> None:
    from tests.redis_servers import own_server

    block = next(b for b in BLOCKS if b.page == REPO / "docs/redis.md")
    assert 'URL = "redis://localhost:6379/0"' in block.code and "run it twice" in block.code
    with own_server() as server:
        code = block.code.replace("redis://localhost:6379/0", server.url)
        runs = [run_block(Block(block.page, block.line, "python", code, None), tmp_path) for _ in range(2)]
    hits = [int(re.findall(r"hits=(\d+)", out)[-1]) for out in runs]
    assert hits == [0, 8]


def test_blocks_not_run_say_why_and_most_blocks_run() -> None:
    skipped = [b for b in BLOCKS if b.reason is not None]
    assert all(b.reason for b in skipped)
    assert len(BLOCKS) - len(skipped) >= 20


def test_a_mark_without_a_reason_or_a_block_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not run: needs a Redis server -->\n```python\nimport redis\n```\n")
    assert [b.not_run for b in blocks_of(page)] == ["needs a Redis server"]
    page.write_text("<!-- not run -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="say why"):
        blocks_of(page)
    page.write_text("<!-- not run: a fragment -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="right before a ```python block"):
        blocks_of(page)
