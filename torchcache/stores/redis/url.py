"""Where a Redis store lives: its URL, parsed by redis-py and checked, and its namespace.

redis-py's ``parse_url`` reads the host, port and credentials; what it lets through (a
cluster scheme, a database name that is not a number, a password without its colon, an
unknown query parameter) is checked here, so that a mistake is a
:class:`~torchcache.errors.ConfigError` that names the argument and says what was
expected, before anything connects. The password never reaches a message: every string
this module makes shows it as ``***`` (:func:`redact_url`, :attr:`RedisAddress.safe_url`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from ...errors import ConfigError

__all__ = ["SCHEMES", "RedisAddress", "check_namespace", "parse_url", "redact_url"]

#: Accepted schemes: ``(tls, cluster)`` for each.
SCHEMES = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
_FORM = "redis://[:PASSWORD@]HOST[:PORT][/DB] (rediss:// for TLS, redis+cluster:// for Redis Cluster)"
_TLS_OPTIONS = {"ssl_ca_certs", "ssl_cert_reqs", "ssl_check_hostname"}
_CERT_REQS = {"required", "optional", "none"}
_NAMESPACE_RE = re.compile(r"[0-9A-Za-z_.-]{1,64}")
_Fail = Callable[[str], ConfigError]


@dataclass(frozen=True)
class RedisAddress:
    """A parsed Redis URL.

    Attributes:
        host: Host name or address.
        port: TCP port.
        db: Database number (always 0 on a cluster).
        tls: Whether to connect with TLS (``rediss://``).
        cluster: Whether the server is a Redis Cluster (``redis+cluster://``).
        username: ACL user name, if any.
        password: Password, if any (never shown by ``repr``).
        tls_options: ``ssl_*`` keyword arguments for the client, from the URL's query.
    """

    host: str
    port: int
    db: int = 0
    tls: bool = False
    cluster: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_options: tuple[tuple[str, str | bool], ...] = ()

    @property
    def safe_url(self) -> str:
        """The URL with the password shown as ``***``."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = ""
        if self.username is not None or self.password is not None:
            auth = f"{self.username or ''}:{'***' if self.password is not None else ''}@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        db = "" if self.cluster else f"/{self.db}"
        return f"{scheme}://{auth}{host}:{self.port}{db}"

    def __repr__(self) -> str:
        return f"RedisAddress({self.safe_url!r})"


def redact_url(url: str) -> str:
    """``url`` with everything between ``://`` and the last ``@`` replaced by ``***``.

    A user name before a colon is kept. The cut is generous on purpose: a password with
    an unescaped ``/`` or ``@`` is still hidden. Values of query parameters other than the
    known TLS options are hidden too (``?password=...``).

    Example:
        >>> redact_url("redis://:s3cret@db:6379/0"), redact_url("redis://me:s3cret@db")
        ('redis://:***@db:6379/0', 'redis://me:***@db')
    """
    url, mark, query = url.partition("?")
    if mark:
        pairs = (pair.partition("=") for pair in query.split("&"))
        query = "&".join(k + eq + (v if k in _TLS_OPTIONS or not eq else "***") for k, eq, v in pairs)
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        userinfo, _, tail = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:***" if colon and not any(ch in user for ch in "/?#[]") else "***"
        url = f"{scheme}{sep}{shown}@{tail}"
    elif "@" in url:
        url = "***@" + url.rpartition("@")[2]
    return url + mark + query


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is 1 to 64 characters of ``[0-9A-Za-z_.-]``.

    Raises:
        ConfigError: If it is not.

    Example:
        >>> check_namespace("3f9a0c1d.v2")
        '3f9a0c1d.v2'
    """
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        shown = repr(namespace)[:80]
        raise ConfigError(
            f"namespace must be 1 to 64 characters of letters, digits, '_', '.' or '-' (a module or "
            f"data set fingerprint, say), got {shown}"
        )
    return namespace


def parse_url(url: object, name: str = "url") -> RedisAddress:
    """Parse and check a Redis URL, with redis-py's own parser.

    Args:
        url: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://...`` for TLS,
            ``redis+cluster://[[USER]:PASSWORD@]HOST[:PORT]`` for a Redis Cluster (any
            node; the others are discovered) or ``rediss+cluster://...``. TLS URLs may
            carry ``ssl_cert_reqs`` (required, optional, none), ``ssl_ca_certs`` (a file)
            and ``ssl_check_hostname`` (true, false) in their query.
        name: The argument's name, for error messages.

    Returns:
        The address, port 6379 and database 0 unless given.

    Raises:
        ConfigError: If the URL is not of that form, or redis-py is not installed.

    Example:
        >>> parse_url("redis://:pw@127.0.0.1:6380/2")
        RedisAddress('redis://:***@127.0.0.1:6380/2')
    """
    if not isinstance(url, str):
        raise ConfigError(f"{name} must be a string such as 'redis://localhost:6379/0', got {type(url).__name__}")
    shown = redact_url(url)[:200]

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"{name} {problem}; expected {_FORM}, got {shown!r}")

    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SCHEMES:
        raise fail(f"must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    tls, cluster = SCHEMES[scheme.lower()]
    if any(ch.isspace() for ch in url) or "#" in url:
        raise fail("must not contain spaces or a fragment (#...)")
    netloc, _, tail = rest.partition("/")
    if "@" in netloc and ":" not in netloc.rpartition("@")[0]:
        raise fail("must put the password after a colon (redis://:PASSWORD@HOST or redis://USER:PASSWORD@HOST)")
    try:
        from redis.connection import parse_url as parse_with_redis
    except ImportError:
        raise ConfigError(
            f"{name} is a Redis URL, which needs the redis package: pip install 'torchcache[redis]'"
        ) from None
    try:
        port = urlsplit(url).port  # what redis-py would fail on later, as a message naming the argument
        parsed = parse_with_redis(("rediss://" if tls else "redis://") + rest.partition("?")[0])  # type: ignore[no-untyped-call]
    except ValueError:
        raise fail("has an invalid port or host") from None
    if not parsed.get("host"):
        raise fail("names no host")
    if port == 0:
        raise fail("has port 0")
    return RedisAddress(
        host=parsed["host"],
        port=parsed.get("port", 6379),
        db=_database(tail.partition("?")[0], cluster, fail),
        tls=tls,
        cluster=cluster,
        username=parsed.get("username"),
        password=parsed.get("password"),
        tls_options=_tls_options(urlsplit(url).query, tls, fail),
    )


def _database(digits: str, cluster: bool, fail: _Fail) -> int:
    if not digits:
        return 0
    if not digits.isascii() or not digits.isdigit() or len(digits) > 6:
        raise fail("must end in a database number such as /0")
    if cluster and int(digits) != 0:
        raise fail("names a database other than 0, which a Redis Cluster does not have")
    return int(digits)


def _tls_options(query: str, tls: bool, fail: _Fail) -> tuple[tuple[str, str | bool], ...]:
    if not query:
        return ()
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise fail("has a malformed query") from None
    options: list[tuple[str, str | bool]] = []
    for key, value in pairs:
        if key not in _TLS_OPTIONS:
            raise fail(f"has an unknown query parameter {key[:40]!r} (known: {', '.join(sorted(_TLS_OPTIONS))})")
        if not tls:
            raise fail(f"has the TLS parameter {key!r} but is not a rediss:// URL")
        if key == "ssl_cert_reqs" and value not in _CERT_REQS:
            raise fail(f"has ssl_cert_reqs={value[:20]!r}, expected one of {', '.join(sorted(_CERT_REQS))}")
        if key == "ssl_check_hostname":
            if value.lower() not in ("true", "false"):
                raise fail(f"has ssl_check_hostname={value[:20]!r}, expected true or false")
            options.append((key, value.lower() == "true"))
        else:
            options.append((key, value))
    return tuple(options)
