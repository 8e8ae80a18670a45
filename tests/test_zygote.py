"""The test suite's zygote: its children are what ``python -c`` or ``python script`` would be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import zygote
from tests.helpers import REPO, python_env

pytestmark = pytest.mark.slow

PROBE = """
import json, os, sys, threading, atexit

def f():
    pass

main = sys.modules["__main__"]
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "in_path": os.environ["PROBE_DIR"] in sys.path,
    "cwd": os.getcwd(),
    "variable": os.environ.get("PROBE_VARIABLE"),
    "main": sorted((k, type(v).__name__) for k, v in vars(main).items() if k.startswith("__")),
    "flags": f.__code__.co_flags,
    "torchcache": "torchcache" in sys.modules,
    "exception": repr(sys.exc_info()[1]),
    "stdin": sys.stdin.read(),
}), flush=True)
atexit.register(lambda: print("at exit", flush=True))
threading.Thread(target=lambda: print("thread joined", flush=True)).start()
sys.exit(int(sys.argv[-1]))
"""


def _both(args: list[str], tmp_path: Path) -> list[tuple[int, str, str]]:
    env = python_env(tmp_path / "extra", PROBE_DIR=str(tmp_path / "extra"), PROBE_VARIABLE="set")
    outcomes = []
    for start in (zygote.start, _fresh):
        child = start(
            args, env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = child.communicate("some input", timeout=120)
        outcomes.append((child.returncode, out, err))
    return outcomes


def _fresh(args: list[str], **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], text=True, **kwargs)  # type: ignore[call-overload]


@pytest.mark.parametrize("as_file", [False, True], ids=["-c", "script"])
def test_a_child_sees_what_a_new_interpreter_sees(tmp_path: Path, as_file: bool) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    args = [str(script), "a", "3"] if as_file else ["-c", PROBE, "a", "3"]
    forked, fresh = _both(args, tmp_path)
    assert forked == fresh
    code, out, err = forked
    assert code == 3 and err == ""
    probe, *rest = out.splitlines()
    assert rest == ["thread joined", "at exit"]
    seen = json.loads(probe)
    assert seen["argv"][1:] == ["a", "3"] and seen["stdin"] == "some input" and seen["variable"] == "set"
    assert seen["in_path"] and seen["cwd"] == str(tmp_path) and not seen["torchcache"]


def test_an_uncaught_exception_and_a_signal_end_a_child_as_they_end_python(tmp_path: Path) -> None:
    (forked_code, _, forked_err), (fresh_code, _, fresh_err) = _both(["-c", "raise ValueError('boom')"], tmp_path)
    assert forked_code == fresh_code == 1
    assert forked_err.splitlines()[-1] == fresh_err.splitlines()[-1] == "ValueError: boom"
    assert "During handling" not in forked_err

    child = zygote.start(
        ["-c", "import sys; print('ready', flush=True); sys.stdin.readline()"],
        env=python_env(),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    os.killpg(child.pid, signal.SIGKILL)  # its own session: a group of its own
    assert child.wait(timeout=60) == -signal.SIGKILL
    assert child.communicate(timeout=60) == ("", None)  # closes the pipes
