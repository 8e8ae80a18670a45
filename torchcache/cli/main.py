"""The ``torchcache`` command line: its argument parser, and :func:`main`, which runs a command.

:func:`main` parses the arguments, hands them to the command's handler in
:mod:`torchcache.cli.commands` and returns its exit status; it turns library errors into
one ``torchcache: error: ...`` line on stderr and status 1 (usage errors give status 2,
as argparse does).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._version import __version__
from ..errors import ConfigError, TorchCacheError
from ..policy import parse_size
from .commands import cmd_clear, cmd_ls, cmd_prune, cmd_verify
from .info import cmd_info
from .migrate import cmd_migrate
from .output import PROG, error, note

__all__ = ["build_parser", "join_sizes", "main", "parse_duration"]

_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*$", re.IGNORECASE)
_NUMBER_RE = re.compile(r"^[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?$")
_UNIT_RE = re.compile(r"^[A-Za-z]{1,3}$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Parse a duration such as ``30d``, ``12h``, ``90m``, ``2w`` or ``45s`` into seconds.

    Raises:
        ValueError: If the text is not a number followed by one of the units s, m, h, d, w.

    Example:
        >>> parse_duration("30d"), parse_duration("90m"), parse_duration("1.5h")
        (2592000.0, 5400.0, 5400.0)
    """
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"invalid duration {text!r}: expected a number and a unit s, m, h, d or w, such as 30d or 12h")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors read ``torchcache: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


_VALUED = ("--max-size", "--older-than", "--keep")


def join_sizes(argv: Sequence[str]) -> list[str]:
    """The arguments with a ``--max-size`` number and the unit after it joined: ``20 GB`` reads as ``20GB``.

    A shell splits ``--max-size 20 GB`` into two words, and the unit would be taken for
    the root. A number followed by a word that makes a size with it (``GB``, ``GiB``,
    ``G``, ``MB``...) is one size.

    Example:
        >>> join_sizes(["prune", "--max-size", "20", "GB"]), join_sizes(["prune", "--max-size=1.5", "TiB", "/data"])
        (['prune', '--max-size', '20GB'], ['prune', '--max-size=1.5TiB', '/data'])
    """
    args = list(argv)
    i = 0
    while i < len(args):
        option, equals, number = args[i].partition("=")
        negative = not equals and i + 1 < len(args) and args[i + 1][:1] == "-" and args[i + 1][1:2].isdigit()
        if negative and len(option) > 3 and any(name.startswith(option) for name in _VALUED):
            args[i : i + 2] = [f"{option}={args[i + 1]}"]  # argparse takes -3d for an option: its message would mislead
            continue
        at = i if equals else i + 1  # the word that holds the number
        if len(option) > 3 and "--max-size".startswith(option) and at + 1 < len(args):
            number = number if equals else args[at]
            unit = args[at + 1]
            if _NUMBER_RE.match(number) and _UNIT_RE.match(unit) and _is_size(number + unit):
                args[at : at + 2] = [args[at] + unit]
        i += 1
    return args


def _is_size(text: str) -> bool:
    try:
        parse_size(text)
    except ConfigError:
        return False
    return True


def _size(text: str) -> int:
    try:
        size = parse_size(text, "--max-size")
        if size and re.fullmatch(r"\s*[\d.eE+-]+\s*", text):  # 20 or 1.5: bytes, and every cache would go
            raise argparse.ArgumentTypeError(
                f"--max-size {text.strip()} has no unit: write 20GB, 500MiB, or 20B for bytes"
            )
        return size
    except ConfigError as exc:
        if "at most" in str(exc):
            raise argparse.ArgumentTypeError(str(exc)) from None
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"--max-size must be a size of 0 or more, got {text!r}") from None
        words = re.fullmatch(r"\s*[+]?[\d.]+\s*([A-Za-z]+)\s*", text)
        unknown = words is not None and not _is_size("1" + words[1])  # 20gigs
        hint = f" (no unit {words[1]!r}: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)" if words and unknown else ""
        raise argparse.ArgumentTypeError(
            f"--max-size must be a size with its unit such as 20GB, 500MiB or 1000000B, got {text!r}{hint}"
        ) from None


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() and "٣".isdigit() are true
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``torchcache`` command."""
    parser = _Parser(
        prog=PROG,
        description="Inspect and maintain torchcache's caches on disk. The default root is the decorator's: "
        "$TORCHCACHE_DIR, else the user cache directory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    root_help = "cache root (default: $TORCHCACHE_DIR, else the user cache directory)"
    key_help = (
        "a module cache directory, or its key (a unique prefix is enough); with --root, a key is looked up "
        "under that root only"
    )

    def command(name: str, summary: str, description: str, handler: Callable[[argparse.Namespace], int]) -> Any:
        sub = commands.add_parser(name, help=summary, description=description)
        sub.set_defaults(handler=handler, parser=sub)
        return sub

    ls = command(
        "ls",
        "list the caches under a root",
        "List the caches under a root (modules, datasets, features), most recently used first.",
        cmd_ls,
    )
    ls.add_argument("root", nargs="?", metavar="ROOT", help=root_help)
    info = command(
        "info",
        "describe one module cache",
        "Describe a module cache: metadata, size, size limit and the layouts of a sample of its entries.",
        cmd_info,
    )
    info.add_argument("target", metavar="DIR_OR_KEY", help=key_help)
    info.add_argument("--root", help=root_help)
    info.add_argument(
        "--sample", type=_count, default=100, metavar="N", help="entries whose headers are read (default: 100)"
    )
    verify = command(
        "verify",
        "check every entry and the index, and look for stray temporary files",
        "Check every module cache's metadata, its packed store's index and every entry (record checksum, frame, "
        "header, payload size), and look for stray temporary files. The exit status is 1 if problems were found "
        "and not fixed.",
        cmd_verify,
    )
    verify.add_argument("path", nargs="?", metavar="ROOT|DIR", help=f"{root_help}, or one module cache")
    verify.add_argument(
        "--fix",
        action="store_true",
        help="remove corrupt entries and stray temporary files, repair the index, rebuild damaged metadata",
    )
    prune = command(
        "prune",
        "remove whole module caches, least recently used first",
        "Remove whole module caches, least recently used first, until the condition holds. A module cache that "
        "a running process has open is kept (with --max-size, more recently used ones may go in its place). "
        "Caches also go on their own: whenever a cache opens, the root is kept under its budget "
        "($TORCHCACHE_MAX_SIZE, default 50GB; `torchcache info` shows it).",
        cmd_prune,
    )
    prune.add_argument("root", nargs="?", metavar="ROOT", help=root_help)
    condition = prune.add_mutually_exclusive_group(required=True)
    condition.add_argument("--max-size", type=_size, metavar="SIZE", help="total size to get under (20GB, 500MiB)")
    condition.add_argument("--older-than", type=_duration, metavar="DURATION", help="last used before (30d, 12h, 2w)")
    condition.add_argument("--keep", type=_count, metavar="N", help="keep the N most recently used")
    prune.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    for sub in (ls, info, verify, prune):
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
    migrate = command(
        "migrate",
        "convert caches of earlier versions to the current format",
        "Pack the one-file-per-entry caches of torchcache 1.0 into packed stores (removing each file once its "
        "entry is stored), turn features files of torchcache 1.2 into rows files, and rewrite the samples of "
        "torchcache 1.2 dataset caches (under a root, or on a Redis server or in a bucket given by URL) in the "
        "current format. Until then the library does not read them. Safe to interrupt and run again.",
        cmd_migrate,
    )
    migrate.add_argument(
        "path", nargs="?", metavar="ROOT|DIR|URL", help=f"{root_help}, one cache, or a Redis or bucket URL"
    )
    clear = command(
        "clear",
        "remove a module cache, or all",
        "Remove a module cache, or every one under the root. Only torchcache's own files are removed; asks for "
        "confirmation unless --yes (and refuses without --yes when stdin is not a terminal).",
        cmd_clear,
    )
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("target", nargs="?", metavar="DIR_OR_KEY", help=key_help)
    which.add_argument("--all", action="store_true", help="every module cache under the root")
    clear.add_argument("--root", help=root_help)
    clear.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchcache`` command.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 on failure or unfixed problems, 2 on a usage error,
        130 when interrupted.
    """
    # A file name that is not UTF-8 is shown escaped, not a crash; the streams are put back after.
    streams = [(s, s.errors) for s in (sys.stdout, sys.stderr) if isinstance(s, io.TextIOWrapper)]
    for stream, _ in streams:
        stream.reconfigure(errors="backslashreplace")
    try:
        return _run(argv)
    finally:
        for stream, errors in streams:
            with contextlib.suppress(ValueError):  # closed meanwhile
                stream.reconfigure(errors=errors)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        words = join_sizes(sys.argv[1:] if argv is None else argv)
        if not words:
            parser.print_help(sys.stderr)
            error("give a COMMAND (torchcache COMMAND --help describes one)")
            return 2
        args, unknown = parser.parse_known_args(words)
        if unknown:  # said with the usage of the command they were given to (ls --jsn)
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    try:
        return int(args.handler(args))
    except BrokenPipeError:  # e.g. `torchcache ls | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (TorchCacheError, OSError) as exc:
        error(str(exc))
        return 1
    except KeyboardInterrupt:
        note("interrupted")
        return 130
