"""Several processes on one cache directory: concurrent writers, persistence, the disk limit."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    FORK_SERVER,
    Counting,
    ProcessGroup,
    assert_all_entries_decode,
    assert_same,
    cached,
    disk_bytes,
    entry_files,
    run_python,
    stored_entries,
)
from torchcache.stores.packed.evict import INDEX_BASE_BYTES
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES, PackedStore

pytestmark = pytest.mark.slow  # every test here starts processes

STORE_FILE = re.compile(r"seg-[0-9a-f]{8}\.tcs")
STORE_NAMES = {"index.lmdb", "index.lmdb-lock", "compact.lock", "index.lock", "seg-N.tcs", "torchcache.json"}

PREAMBLE = """
import json, sys, torch
from tests.helpers import Counting, cached

def inputs(n, seed):
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))

def report(model, **extra):
    s = model.cache_instance.stats()
    disk = s.disk
    print(json.dumps({"hits": s.hits, "misses": s.misses, "items": model.items,
                      "disk_hits": disk.hits, "disk_entries": disk.entries, "disk_bytes": disk.bytes, **extra}))
"""


class Workers(ProcessGroup):
    """Workers forked by a :data:`FORK_SERVER` running ``script`` (which calls ``serve(work)``)."""

    def __init__(self, script: str, stderr: Path, timeout: float = 300) -> None:
        super().__init__(FORK_SERVER + PREAMBLE + script, stderr, timeout)
        self.backlog: list[tuple[str, str]] = []

    def line(self, name: str) -> str:
        """The next line worker ``name`` printed (without its name); lines of others are kept."""
        for i, (who, text) in enumerate(self.backlog):
            if who == name:
                del self.backlog[i]
                return text
        while True:
            line = self.readline()
            who, _, text = line.strip().partition(" ")
            assert text != "error", self.stderr.read_text()[-3000:]
            if who == name:
                return text
            self.backlog.append((who, text))

    def start(self, name: str, *args: object) -> None:
        self.send("start", name, *args)
        # The server says "pid" after the fork, so the worker's first lines may come before it.
        early = []
        while not (text := self.line(name)).startswith("pid "):
            early.append((name, text))
        self.backlog[:0] = early

    def tell(self, name: str, *words: object) -> None:
        self.send("tell", name, *words)

    def wait(self, name: str) -> int:
        self.send("wait", name)
        words = self.line(name).split()
        assert words[0] == "status", words
        return int(words[1])


WRITER = textwrap.dedent(
    """
    def work(name, n, order_seed, say, ask):
        n = int(n)
        x = inputs(n, 11)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(int(order_seed)))
        model = cached(Counting, persistent=True, max_memory_cache_size=0)()
        say("ready")
        assert ask() == "go"  # start writing together
        for start in range(0, n, 16):
            index = order[start : start + 16]
            assert torch.equal(model(x[index]), Counting()(x[index]))
        model.cache_instance.flush()
        stats = model.cache_instance.stats()
        say(stats.hits, stats.misses)

    serve(work)
    """
)


def test_two_processes_writing_at_once_leave_valid_entries(cache_root: Path, tmp_path: Path) -> None:
    n = 240
    workers = Workers(WRITER, stderr=tmp_path / "stderr")
    try:
        for seed in (1, 2):
            workers.start(f"w{seed}", n, seed)
        assert [workers.line("w1"), workers.line("w2")] == ["ready", "ready"]
        for name in ("w1", "w2"):
            workers.tell(name, "go")
        counts = [list(map(int, workers.line(name).split())) for name in ("w1", "w2")]
        assert [workers.wait("w1"), workers.wait("w2")] == [0, 0]
    finally:
        workers.close()
    assert [sum(count) for count in counts] == [n, n]  # hits and misses

    files = entry_files(cache_root)
    assert len(files) == n
    assert_all_entries_decode(cache_root)
    names = {STORE_FILE.sub("seg-N.tcs", p.name) for p in cache_root.rglob("*") if p.is_file()}
    assert {"index.lmdb", "seg-N.tcs", "torchcache.json"} <= names <= STORE_NAMES  # no temporary file left
    writers = sum(1 for _, misses in counts if misses)  # one may find every entry already written by the other
    segments = list(cache_root.glob("*/seg-*.tcs"))
    assert writers >= 1 and len(segments) >= writers, (counts, segments)  # each writer has a segment of its own

    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(11))
    reader = cached(Counting, persistent=True)()
    assert_same(reader(x), Counting()(x))
    stats = reader.cache_instance.stats()
    assert stats.misses == 0
    assert stats.disk is not None and stats.disk.hits == n
    assert reader.items == 0


READER = PREAMBLE + textwrap.dedent(
    """
    x = inputs(int(sys.argv[1]), 21)
    model = cached(Counting, persistent=True)()
    out = model(x)
    report(model, equal=torch.equal(out, Counting()(x)))
    """
)


def test_a_fresh_process_hits_what_another_process_stored(cache_root: Path) -> None:
    n = 50
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(21))
    model = cached(Counting, persistent=True)()
    model(x)
    model.cache_instance.flush()

    result = run_python(READER, str(n))
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["equal"] is True
    assert (stats["hits"], stats["misses"], stats["items"]) == (n, 0, 0)
    assert stats["disk_hits"] == n


SECOND_RUN = PREAMBLE + textwrap.dedent(
    """
    limit, n = int(sys.argv[1]), int(sys.argv[2])
    x = inputs(n, 32)
    model = cached(Counting, persistent=True, max_persistent_cache_size=limit)(4, 256)
    out = model(x)
    model.cache_instance.flush()
    report(model, equal=torch.equal(out, Counting(4, 256)(x)))
    """
)


def charged_bytes(directory: Path) -> int:
    """What the packed store in ``directory`` charges to its budget: records, and the index's share."""
    with PackedStore(directory, 1 << 40) as store:
        usage = store.usage()
    index_bytes = sum(p.stat().st_blocks * 512 for p in directory.glob("index.lmdb*"))
    return usage["records"] + max(INDEX_ENTRY_BYTES * usage["entries"], index_bytes - INDEX_BASE_BYTES)


def test_disk_limit_counts_what_an_earlier_run_left(cache_root: Path, tmp_path: Path) -> None:
    # 1 kB outputs; the first run's budget gives it segments of 16 kB, about 14 entries each
    first_limit, limit, n = 256 * 1024, 48 * 1024, 16
    first = cached(Counting, persistent=True, max_persistent_cache_size=first_limit)(4, 256)
    first(torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(31)))
    first.cache_instance.flush()
    directory = first.cache_instance.cache_dir
    first_entries = set(entry_files(cache_root))
    assert len(first_entries) == 4 * n
    assert limit < charged_bytes(directory) <= first_limit  # what the second run finds is over its limit
    with PackedStore(tmp_path / "same budget", first_limit) as same:
        open_segment = same.segment_bytes

    result = run_python(SECOND_RUN, str(limit), str(n))  # alone, its n entries fit easily
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["equal"] is True
    # Evicted down to the limit; the first run is still alive and still holds its open
    # segment, which no other process may evict: the documented slack of one open
    # segment per live writer.
    assert charged_bytes(directory) <= limit + open_segment
    assert stats["disk_bytes"] == disk_bytes(cache_root)
    assert stats["disk_entries"] == len(entry_files(cache_root))
    # without counting the first run's entries all 5 * n would be kept
    assert len(entry_files(cache_root)) < 5 * n
    assert len(set(entry_files(cache_root)) & first_entries) < 4 * n
    assert_all_entries_decode(cache_root)


FORKED = PREAMBLE + textwrap.dedent(
    """
    import faulthandler, os, signal, traceback
    faulthandler.dump_traceback_later(100, exit=True)  # a hang of the parent prints its threads' stacks
    x = inputs(200, 41)
    plain = Counting()
    model = cached(Counting, persistent=True, max_memory_cache_size=0)()
    model(x[:100])
    model.cache_instance.flush()
    assert torch.equal(model(x[:100]), plain(x[:100]))  # disk hits: the read pool has threads now
    model(x[150:])  # writes in flight while forking
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hang ends the child (status -14) instead of the test run
        try:
            equal = torch.equal(model(x[100:150]), plain(x[100:150]))  # new items: written by the child
            equal &= torch.equal(model(x[:100]), plain(x[:100]))  # disk hits through a new read pool
            model.cache_instance.flush()
            os._exit(0 if equal else 3)
        except BaseException:
            traceback.print_exc()
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    model.cache_instance.flush()
    print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
    """
)


def test_a_forked_child_reads_writes_and_flushes_without_hanging(cache_root: Path) -> None:
    result = run_python(FORKED)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"child": 0}, result.stderr
    assert len(entry_files(cache_root)) == 200
    assert_all_entries_decode(cache_root)


CHILDREN = PREAMBLE + textwrap.dedent(
    """
    import multiprocessing, multiprocessing.util, threading
    import torchcache.tiers.persistent

    def work(seed, start):
        # Hold every write back until the child is exiting, so that only a flush at exit
        # can put the entries on disk (finalizers of higher priority run first).
        exiting = threading.Event()
        multiprocessing.util.Finalize(None, exiting.set, exitpriority=100)
        real_job = torchcache.tiers.persistent.PersistentTier._write_job

        def held_back(self, job):
            assert exiting.wait(60), "the child never started exiting"
            real_job(self, job)

        torchcache.tiers.persistent.PersistentTier._write_job = held_back
        model = cached(Counting, persistent=True)()
        model(inputs(40, seed)[start : start + 20])  # no flush(): the child's exit must write the entries

    if __name__ == "__main__":
        for seed, method in enumerate(("fork", "spawn")):
            context = multiprocessing.get_context(method)
            children = [context.Process(target=work, args=(seed, start)) for start in (0, 20)]
            for child in children:
                child.start()
            for child in children:
                child.join(120)
            print(method, [child.exitcode for child in children])
    """
)


def test_multiprocessing_children_flush_their_writes_at_exit(cache_root: Path, tmp_path: Path) -> None:
    result = run_python(CHILDREN, path=tmp_path / "children.py", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["fork [0, 0]", "spawn [0, 0]"], result.stderr
    assert len(entry_files(cache_root)) == 80  # 40 items of each start method
    assert_all_entries_decode(cache_root)


LOADER = PREAMBLE + textwrap.dedent(
    """
    from torch.utils.data import DataLoader, Dataset
    from torchcache import torchcache

    @torchcache(persistent=True)
    def embed(x):
        return x * 2 + 1

    class Samples(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return embed(inputs(32, 61)[i : i + 1])[0]  # cached in the worker, never flushed by hand

    if __name__ == "__main__":
        loader = DataLoader(Samples(), batch_size=8, num_workers=2, multiprocessing_context="fork")
        out = torch.cat(list(loader))
        print(json.dumps({"equal": torch.equal(out, inputs(32, 61) * 2 + 1)}))
    """
)


def test_dataloader_workers_write_their_entries(cache_root: Path, tmp_path: Path) -> None:
    result = run_python(LOADER, path=tmp_path / "loader.py", timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"equal": True}
    assert len(entry_files(cache_root)) == 32
    assert_all_entries_decode(cache_root)


# -- several processes at once: overlapping keys, entries seen without a restart ---------------
BLOCKS, BLOCK_BATCHES = 8, 3
READERS_WRITERS = textwrap.dedent(
    f"""
    def block(b):
        return [inputs(16, 1000 + {BLOCK_BATCHES} * b + i) for i in range({BLOCK_BATCHES})]

    def work(name, me, say, ask):
        me = int(me)
        plain = Counting()
        model = cached(Counting, persistent=True, max_memory_cache_size=0)()  # every hit read from disk

        def check(batches):
            wrong = 0
            for x in batches:
                wrong += not torch.equal(model(x), plain(x))
                model.cache_instance.flush()  # visible to the others at once
            return wrong

        say("ready")
        assert ask() == "go"
        # four blocks, each shared with the next worker and the one before: the same keys are
        # written and read by two processes at once, each in an order of its own
        mine = [b % {BLOCKS} for b in range(2 * me, 2 * me + 4)]
        batches = [x for b in mine for x in block(b)]
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(me)).tolist()
        wrong = check([batches[i] for i in order])
        first = model.cache_instance.stats()
        say("wrote")
        assert ask() == "go"
        wrong += check([x for b in range({BLOCKS}) for x in block(b)])  # every block, the others' included
        second = model.cache_instance.stats()
        say(json.dumps({{"wrong": wrong, "first": [first.hits, first.misses],
                         "second": [second.hits - first.hits, second.misses - first.misses]}}))

    serve(work)
    """
)


def test_four_processes_writing_and_reading_overlapping_keys_get_every_value_right(
    cache_root: Path, tmp_path: Path
) -> None:
    names = [f"w{me}" for me in range(4)]
    workers = Workers(READERS_WRITERS, stderr=tmp_path / "stderr")
    try:
        for me, name in enumerate(names):
            workers.start(name, me)
        assert [workers.line(name) for name in names] == ["ready"] * 4
        for name in names:  # all start together
            workers.tell(name, "go")
        assert [workers.line(name) for name in names] == ["wrote"] * 4
        for name in names:  # each has flushed its writes: every block is stored now
            workers.tell(name, "go")
        reports = [json.loads(workers.line(name)) for name in names]
        assert [workers.wait(name) for name in names] == [0] * 4
    finally:
        workers.close()
    items = BLOCKS * BLOCK_BATCHES * 16
    for name, report in zip(names, reports):
        assert report["wrong"] == 0, (name, report)
        assert sum(report["first"]) == items // 2, (name, report)
        assert report["second"] == [items, 0], (name, report)  # all hits, and all right
    assert len(stored_entries(cache_root)) == items
    assert_all_entries_decode(cache_root)


RUNNING = textwrap.dedent(
    """
    def work(name, seed, say, ask):
        model = cached(Counting, persistent=True, max_memory_cache_size=0)()
        plain = Counting()
        model(inputs(4, int(seed)))  # the store is open (and this process has a segment of its own)
        model.cache_instance.flush()
        say("open")
        while (order := ask()) != "quit":
            n, seed = map(int, order.split())
            x = inputs(n, seed)
            hits, items = model.cache_instance.stats().hits, model.items
            out = model(x)
            model.cache_instance.flush()
            say(torch.equal(out, plain(x)), model.cache_instance.stats().hits - hits, model.items - items)

    serve(work)
    """
)


def test_an_entry_one_running_process_writes_is_found_by_another_without_a_restart(
    cache_root: Path, tmp_path: Path
) -> None:
    workers = Workers(RUNNING, stderr=tmp_path / "stderr")
    try:
        workers.start("a", 70)
        workers.start("b", 71)
        assert [workers.line("a"), workers.line("b")] == ["open", "open"]  # both have the store open
        workers.tell("a", 24, 81)
        assert workers.line("a") == "True 0 24"  # equal, hits, computed
        workers.tell("b", 24, 81)  # what a stored, asked of b
        assert workers.line("b") == "True 24 0"
        workers.tell("b", 30, 82)  # and the other way round
        assert workers.line("b") == "True 0 30"
        workers.tell("a", 30, 82)
        assert workers.line("a") == "True 30 0"
        for name in ("a", "b"):
            workers.tell(name, "quit")
        assert [workers.wait("a"), workers.wait("b")] == [0, 0]
    finally:
        workers.close()
    assert len(stored_entries(cache_root)) == 4 + 4 + 24 + 30
    assert_all_entries_decode(cache_root)


IN_FLIGHT = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading
    from torchcache.stores.packed.index import open_index
    from torchcache.stores.packed.store import PackedStore

    root, key = sys.argv[1], "a" * 32
    store = PackedStore(root, max_bytes=10**6)
    store.put_many([(key, b"x" * 100)])
    store.flush()
    index = open_index(root, readonly=False)  # the store's environment, shared
    held = index.env.begin(write=True)  # this thread holds the write lock: the next writer waits in LMDB
    waiter = threading.Thread(target=lambda: index.env.begin(write=True).abort(), daemon=True)
    waiter.start()
    task = f"/proc/self/task/{waiter.native_id}/wchan"
    while not os.path.exists(task) or "futex" not in open(task).read():  # until it waits inside py-lmdb
        pass
    subprocess.run(["true"], preexec_fn=lambda: None, check=True)  # a child that runs another program
    pid = os.fork()  # a child that uses the store
    if pid == 0:
        got = PackedStore(root, max_bytes=10**6).get(key)  # the parent's environment was in use at the fork
        os._exit(0 if got in (None, b"x" * 100) else 3)
    _, status = os.waitpid(pid, 0)
    held.abort()
    waiter.join()
    print(json.dumps({"child": os.waitstatus_to_exitcode(status), "parent": bytes(store.get(key))[:1].decode()}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to see a thread wait")
def test_a_fork_while_another_thread_is_inside_lmdb_never_hangs_the_child(tmp_path: Path) -> None:
    result = run_python(IN_FLIGHT, str(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"child": 0, "parent": "x"}, result.stderr


WRITE_IN_FLIGHT = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading
    from torchcache.stores.packed.index import INDEX_NAME, TRANSACTIONS, open_index
    from torchcache.stores.packed.store import PackedStore

    root = sys.argv[1]
    store = PackedStore(root, max_bytes=10**6)
    store.put_many([("a" * 32, b"x" * 100)])
    store.flush()
    index = open_index(root, readonly=False)  # the store's environment, shared
    holder = subprocess.Popen(  # another process holds the write lock until told to let go
        [sys.executable, "-c", "import lmdb, sys; env = lmdb.open(sys.argv[1], subdir=False, max_dbs=3); "
         "txn = env.begin(write=True); print('held', flush=True); sys.stdin.readline(); txn.abort()",
         os.path.join(root, INDEX_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline() == "held\\n"
    writer = threading.Thread(target=lambda: index.change().abort())  # a background write, waiting inside LMDB
    writer.start()
    task = f"/proc/self/task/{writer.native_id}/wchan"
    while not os.path.exists(task) or "futex" not in open(task).read():
        pass

    def let_go() -> None:  # once the fork has begun
        while not TRANSACTIONS._forking:
            pass
        holder.communicate("\\n")

    threading.Thread(target=let_go).start()
    pid = os.fork()  # a DataLoader worker, forked while the parent writes
    if pid == 0:
        child = PackedStore(root, max_bytes=10**6)
        child.put_many([("b" * 32, b"y" * 100)])
        child.flush()
        os._exit(0 if child.get("b" * 32) == b"y" * 100 and child.get("a" * 32) == b"x" * 100 else 3)
    _, status = os.waitpid(pid, 0)
    writer.join()
    print(json.dumps({"child": os.waitstatus_to_exitcode(status), "parent": bytes(store.get("b" * 32))[:1].decode()}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to see a thread wait")
def test_a_child_forked_during_a_write_transaction_keeps_its_disk_store(tmp_path: Path) -> None:
    result = run_python(WRITE_IN_FLIGHT, str(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"child": 0, "parent": "y"}, result.stderr
