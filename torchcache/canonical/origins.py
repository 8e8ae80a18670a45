"""Where code comes from: the user's own files, or the standard library and installed packages.

Code of the standard library and of installed packages changes only with their version,
so it is keyed by the package's version (``torch==2.13.0``, its local part such as
``+cpu`` dropped, so that CPU and CUDA builds of one release share keys); a package
installed from a local directory or a repository, whose version rarely changes between
edits, also by the hashes of its installed files. Everything else
(scripts, notebooks, editable installs, code made by ``exec``) is the user's, keyed by
its code. torchcache's own files count as installed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import sysconfig
import types

import xxhash

__all__ = [
    "OWN_PACKAGE",
    "extension_digest",
    "file_digest",
    "is_installed_file",
    "is_users_object",
    "made_elsewhere",
    "origin_of_module",
    "version_of",
]

OWN_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    roots.update(getattr(site, "getsitepackages", list)())
    user_site = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user_site, str):
        roots.add(user_site)
    # not sys.base_prefix as a whole: under a system Python it is /usr, and /usr/src/app is the user's code
    return tuple(sorted({os.path.abspath(root) + os.sep for root in roots if root}))


_roots: tuple[str, ...] | None = None
_file_origins: dict[str, bool] = {}
_versions: dict[str, str] = {}


def is_installed_file(filename: str) -> bool:
    """Whether code from ``filename`` belongs to the standard library, an installed package or torchcache."""
    global _roots
    found = _file_origins.get(filename)
    if found is None:
        if filename.startswith("<frozen "):
            found = True
        elif not filename or filename.startswith("<"):
            found = False  # made by exec or eval (a dataclass's __init__, a notebook cell): keyed by code
        else:
            if _roots is None:
                _roots = _installed_roots()
            path = os.path.abspath(filename)
            parts = path.split(os.sep)
            found = (
                path.startswith(OWN_PACKAGE)
                or "site-packages" in parts
                or "dist-packages" in parts
                or any(path.startswith(root) for root in _roots)
            )
        _file_origins[filename] = found
    return found


def origin_of_module(name: str) -> str | None:
    """``package==version`` for a module of the standard library or an installed package, else ``None``."""
    module = sys.modules.get(name)
    if module is None or name == "__main__":  # the script being run is the user's, wherever it lies
        return None
    filename = getattr(module, "__file__", None)
    top = name.partition(".")[0]
    if filename is None:
        if top in sys.builtin_module_names or top in sys.stdlib_module_names:
            return version_of(top)
        return None
    return version_of(top) if is_installed_file(filename) else None


def version_of(top: str) -> str:
    """What identifies the code of an installed package: its version, or its files' hashes when built locally.

    A package installed from an index is keyed by its version, its local part dropped
    (``torch==2.13.0`` for ``2.13.0+cpu``). One installed from a local directory or a
    repository (``pip install .``, whose version rarely changes between edits) is keyed
    by the hashes its ``RECORD`` lists for its files as well.
    """
    found = _versions.get(top)
    if found is not None:
        return found
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "builtins":
        found = f"python=={sys.version_info[0]}.{sys.version_info[1]}"
    else:
        distribution = _distribution(top, scan=False)
        version = getattr(sys.modules.get(top), "__version__", None)
        if distribution is None and not isinstance(version, str):
            distribution = _distribution(top, scan=True)  # sklearn from scikit-learn, without a __version__
        if distribution is not None:
            found = f"{top}=={distribution.version.split('+')[0]}" + _built_locally(distribution)
        else:
            found = f"{top}=={version.split('+')[0]}" if isinstance(version, str) else f"{top}@{_files_digest(top)}"
    _versions[top] = found
    return found


def _distribution(top: str, scan: bool) -> importlib.metadata.Distribution | None:
    """The installed distribution that provides the top-level package ``top``, if there is one.

    Found by its name first; with ``scan``, among every distribution's files (a tenth of
    a second or so).
    """
    try:
        return importlib.metadata.distribution(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    if not scan:
        return None
    for name in importlib.metadata.packages_distributions().get(top, ()):
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _built_locally(distribution: importlib.metadata.Distribution) -> str:
    """``|files-<digest>`` of the file hashes in ``RECORD`` for a package built or installed from this machine.

    That is one installed from a directory, a repository or a local archive (a wheel or
    sdist rebuilt under the same version): its version does not tell its code.
    """
    try:
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
    except (ValueError, OSError):
        direct = {}
    if not isinstance(direct, dict):
        return ""
    local = str(direct.get("url", "")).startswith("file:")
    if not ("dir_info" in direct or "vcs_info" in direct or local):
        return ""
    record = distribution.read_text("RECORD") or ""
    # Files outside the package (scripts pip writes with this environment's interpreter in them) left out.
    paths = ((line, line.split(",", 1)[0]) for line in record.splitlines() if ",sha256=" in line)
    lines = sorted(line for line, path in paths if ".dist-info/" not in path and not path.startswith("../"))
    return "|files-" + xxhash.xxh3_128_hexdigest("\n".join(lines).encode())


def _files_digest(top: str) -> str:
    """The content of a package's Python files (one added to ``sys.path`` by hand, without metadata)."""
    filename = getattr(sys.modules.get(top), "__file__", None)
    if filename is None and top not in sys.modules:  # not imported yet: found where an import would find it
        with contextlib.suppress(ImportError, ValueError):
            filename = getattr(importlib.util.find_spec(top), "origin", None)
    if filename is None or not os.path.isfile(filename):
        return "unknown"
    h = xxhash.xxh3_128()
    directory = os.path.dirname(filename) if filename.endswith("__init__.py") else ""
    files = (
        [filename]
        if not directory
        else sorted(
            os.path.join(folder, name)
            for folder, _, names in os.walk(directory)
            for name in names
            if name.endswith(".py")
        )
    )
    for path in files:
        with open(path, "rb") as handle:
            h.update(handle.read())
    return "files-" + h.hexdigest()


def is_users_object(member: object) -> bool:
    """Whether a function or class comes from the user's code (not the standard library or a package)."""
    module = getattr(member, "__module__", None)
    return isinstance(module, str) and origin_of_module(module) is None


_HEAP_TYPE = 1 << 9  #: Py_TPFLAGS_HEAPTYPE: a class made at run time, not one built into the interpreter


def made_elsewhere(klass: type) -> bool:
    """Whether a class names a module that does not hold it: the user's, keyed as a class of the user's is.

    ``types.new_class`` and ``make_dataclass`` name the classes they make after the
    standard library (``types.K``); a class of a package named so holds functions of the
    user's files (``__module__ = "torch.nn"`` for a shorter repr).
    """
    found: object = sys.modules.get(klass.__module__)
    for part in klass.__qualname__.split("."):
        found = vars(found).get(part) if isinstance(found, (types.ModuleType, type)) else None  # no __getattr__ runs
    if found is klass:
        return False
    funcs = [v.__func__ if isinstance(v, (staticmethod, classmethod)) else v for v in vars(klass).values()]
    if klass.__module__.partition(".")[0] in sys.stdlib_module_names:  # types.new_class, make_dataclass
        # made at run time with Python code (not NoneType, function or _thread.lock, which no module exposes)
        return bool(klass.__flags__ & _HEAP_TYPE) and any(isinstance(f, types.FunctionType) for f in funcs)
    return any(isinstance(f, types.FunctionType) and _users_file(f.__code__.co_filename) for f in funcs)


def _users_file(filename: str) -> bool:
    """Whether ``filename`` is a file of the user's (not one exec made, nor an installed one)."""
    return not filename.startswith("<") and not is_installed_file(filename)


_files: dict[tuple[str, int, int], str] = {}


def file_digest(filename: str) -> str | None:
    """The xxh3-128 of a file's bytes (kept per path, modification time and size), or ``None`` if it cannot be read."""
    try:
        stat = os.stat(filename)
        found = _files.get((filename, stat.st_mtime_ns, stat.st_size))
        if found is None:
            with open(filename, "rb") as file:
                found = _files[(filename, stat.st_mtime_ns, stat.st_size)] = xxhash.xxh3_128_hexdigest(file.read())
    except OSError:
        return None
    return found


def extension_digest(name: str) -> str | None:
    """The xxh3-128 of the compiled file of a user's extension module (built in place, not installed), if any."""
    filename = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(filename, str) or filename.endswith(".py"):
        return None
    return file_digest(filename)
