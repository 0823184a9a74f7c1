"""The one configuration object of a running router.

`cli.py` builds a `Config` from the command line and the environment, once, and passes it down.
Nothing else in the package reads `os.environ` or argv: a module that needs a setting takes it
from here (or from its constructor), so every behaviour can be set up in a test without globals.

A `Config` validates itself when it is built (`__post_init__`), so one built in code (tests,
the demo) is held to the same rules as one built from flags; each error is a ValueError whose
message names the flag, which `cli.py` turns into its one-line usage message.

The replica token is held as a `Secret`, whose `repr` never shows the value, so a `Config`
can be logged or printed in a traceback without leaking it. The token goes only to replicas
inside the allow-list (`replica_allowed`: `--replica-hosts`, by default the `--replicas`
themselves), which every way a replica joins (the command line, `POST /router/replicas`)
passes through; `secret_from_env` reads a secret from a variable NAME and never echoes a value
given in its place.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import ipaddress
import math
import os
import re
import resource
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from lora_router.routes import forward_path_error
from lora_router.routing.keys import DEFAULT_LINEAGE_PATTERN, Lineages
from lora_router.routing.policy import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_SLACK,
    DEFAULT_MOVE_PRICE,
    DEFAULT_TABLE_SIZE,
    DEFAULT_VNODES,
    POLICIES,
    ParamError,
    PolicyParams,
)


class Secret:
    """A string that never shows itself in `repr`/`str` (tokens, API keys)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return bool(self._value)


@dataclass(frozen=True, slots=True)
class ReplicaAddress:
    """Where one replica lives: scheme, host, port and an optional path prefix.

    `name` is the URL as the operator wrote it, normalised: the scheme and host in lower case,
    an IP address in its shortest form (`[0:0::1]` is `[::1]`), the port always written (80
    and 443 when the URL gives none), the path prefix without `.` and `..` segments and
    without a trailing `/`. Two URLs with one name are one replica (the fleet has one member
    per name); two names are two replicas, though two host names may lead to one server
    (fleet/aliases.py says so). The hash ring is built from names, so two routers given the
    same URLs agree on every placement.
    """

    name: str
    scheme: str
    host: str
    port: int
    path_prefix: str

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> ReplicaAddress:
        """Parse `http(s)://host[:port][/prefix]`; raise ValueError with a readable reason."""
        text = url.strip()
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"replica URL {text!r} must start with http:// or https://")
        if not parts.hostname:
            raise ValueError(f"replica URL {text!r} has no host")
        if parts.username or parts.password:
            raise ValueError(f"replica URL {text!r} must not carry credentials; use --token-env")
        if parts.query or parts.fragment:
            raise ValueError(f"replica URL {text!r} must not have a query or fragment")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"replica URL {text!r} has an invalid port") from exc
        if port == 0:
            raise ValueError(f"replica URL {text!r} has port 0, which no server listens on")
        port = port or (443 if parts.scheme == "https" else 80)
        prefix = _path_prefix(parts.path)
        host = parts.hostname
        if _ip_literal(host):
            host = ipaddress.ip_address(host).compressed
        elif not _dns_name(host):
            raise ValueError(
                f"replica URL {text[:200]!r} has a host that is neither an IP address nor a DNS "
                "name (dot-separated labels of letters, digits, '-' and '_', the last not a "
                "number)"
            )
        shown_host = f"[{host}]" if ":" in host else host
        name = f"{parts.scheme}://{shown_host}:{port}{prefix}"
        return cls(name=name, scheme=parts.scheme, host=host, port=port, path_prefix=prefix)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHOWN_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")  # HF_TOKEN, not hf_AbC...: shown in errors


def secret_from_env(flag: str, name: str, environ: Mapping[str, str]) -> Secret:
    """The secret in the environment variable `name`, given as `flag`; ValueError if there is
    none. A `name` that is not a variable name, or does not look like a conventional one, is
    never echoed: it may be the secret itself, pasted in its place."""
    if not _ENV_NAME.fullmatch(name):
        raise ValueError(
            f"{flag} takes the NAME of an environment variable (such as HF_TOKEN), and what was "
            "given is not one (not shown: it may be the secret itself)"
        )
    if not environ.get(name):
        if not shown_name(name):
            raise ValueError(
                f"{flag} (the name given; not shown): that variable is not set or empty. "
                f"{flag} takes the NAME of the variable that holds the secret (such as "
                "HF_TOKEN): did you pass the secret itself?"
            )
        raise ValueError(f"{flag} {name}: that variable is not set or empty")
    return Secret(environ[name])


def shown_name(name: str) -> bool:
    """Whether a variable's name may be shown in a message: named by convention (HF_TOKEN),
    so not a secret pasted in its place (hf_AbC...)."""
    return bool(name) and _SHOWN_NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class HostPattern:
    """One `--replica-hosts` entry: a host glob (`*.hf.jobs`), a host (`10.0.0.5`), or an IP
    network (`10.0.0.0/8`), the first two optionally with `:PORT`, any of them optionally
    prefixed by the one scheme it admits (`https://*.hf.jobs`, `http://10.0.0.0/8`; without
    a prefix, either).

    Names are matched as written, never resolved. A network, and a glob written like an IP
    address (digits, dots and wildcards: `10.0.0.*`; or with a colon: `fd00::*`), admit IP
    literals only: `10.0.0.*` never admits the DNS name `10.0.0.attacker.example`, which
    would be resolved at connect time wherever its owner points it. Whatever the pattern, an
    http address is never admitted where the fleet knows an https one (`Fleet.downgrade`)."""

    text: str
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    port: int | None = None
    scheme: str | None = None  # http or https; None: either
    ip_only: bool = False

    @classmethod
    def parse(cls, entry: str) -> HostPattern:
        text = entry.strip().lower()
        bad = ValueError(
            f"--replica-hosts {entry.strip()!r}: expected a host glob (*.hf.jobs), a host with "
            "an optional :PORT (10.0.0.5:8000, [fd00::5]:8000) or a network (10.0.0.0/8), "
            "optionally after http:// or https://"
        )
        scheme, sep, rest = text.partition("://")
        if sep:
            if scheme not in ("http", "https"):
                raise bad
            text = rest
        else:
            scheme = ""
        pattern = cls._parse(text, bad)
        return dataclasses.replace(pattern, scheme=scheme or None)

    @classmethod
    def _parse(cls, text: str, bad: ValueError) -> HostPattern:
        if "/" in text:
            try:
                return cls(text, network=ipaddress.ip_network(text, strict=False), ip_only=True)
            except ValueError:
                raise bad from None
        host, port = text, None
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            if rest and not (rest.startswith(":") and rest[1:].isdigit()):
                raise bad
            port = int(rest[1:]) if rest else None
        elif text.count(":") == 1:
            host, _, digits = text.partition(":")
            if not digits.isdigit():
                raise bad
            port = int(digits)
        if not host or (port is not None and not 0 < port < 65536):
            raise bad
        try:  # an IP literal is compared as an address (::1 and 0::1 are one host)
            return cls(host, network=ipaddress.ip_network(host), port=port, ip_only=True)
        except ValueError:
            ip_like = ":" in host or bool(_IP_GLOB.fullmatch(host) and _DIGIT.search(host))
            return cls(host, port=port, ip_only=ip_like)

    def matches(self, address: ReplicaAddress) -> bool:
        if self.port is not None and self.port != address.port:
            return False
        if self.scheme is not None and self.scheme != address.scheme:
            return False
        if self.ip_only and not _ip_literal(address.host):
            return False
        if self.network is None:
            return fnmatch.fnmatchcase(address.host.lower(), self.text)
        try:
            return ipaddress.ip_address(address.host) in self.network
        except ValueError:
            return False  # a name: never resolved here


@functools.lru_cache(maxsize=8)
def _host_patterns(hosts: tuple[str, ...]) -> tuple[HostPattern, ...]:
    """`--replica-hosts`, parsed once (discovery judges every entry it reads against them)."""
    return tuple(HostPattern.parse(p) for p in hosts)


@dataclass(frozen=True, slots=True)
class Config:
    """Every setting of a router process, grouped as in `lora-router --help`."""

    # Replicas and credentials
    replicas: tuple[ReplicaAddress, ...]
    token: Secret = field(default_factory=lambda: Secret(""))
    token_env: str = ""  # the variable --token-env named ("" with --no-token)
    ca_file: str | None = None
    # Where a replica may be added (HostPattern entries); empty: the --replicas' own host:port.
    replica_hosts: tuple[str, ...] = ()

    # Discovery (fleet/discovery.py): more members from files, A/AAAA and SRV records.
    replicas_files: tuple[str, ...] = ()
    replicas_dns: tuple[str, ...] = ()  # NAME:PORT
    replicas_srv: tuple[str, ...] = ()  # _service._proto.name
    dns_server: str | None = None  # HOST:PORT; None: the system's resolvers
    dns_interval: float = 5.0
    discovery_grace: float = 30.0  # how long a member may be missing before it drains

    # Listening
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Secret = field(default_factory=lambda: Secret(""))
    insecure_listen: bool = False
    forward_paths: tuple[str, ...] = ()  # paths opened to one replica (routes.py)

    # Routing
    policy: str = "prefix"  # prefix | round-robin | least-loaded | kv
    # With --policy kv, where replicas publish KV events: auto (/kv_event_sources), off, or
    # ENDPOINT[,REPLAY] templates with {host} (fleet/kv_events.py).
    kv_events: str = "auto"
    block_size: int | None = None  # None: read cache_config.block_size from the replicas, else 16
    # The policy's parameters, with its defaults (routing/policy.py's PolicyParams owns them).
    load_factor: float = DEFAULT_LOAD_FACTOR  # ε of consistent hashing with bounded loads
    load_slack: int = DEFAULT_LOAD_SLACK  # requests in flight a replica may take over the mean
    # A first later turn leaves a home heavier by more than this many times its prompt (0: never).
    move_price: int = DEFAULT_MOVE_PRICE
    vnodes: int = DEFAULT_VNODES
    affinity_table_size: int = DEFAULT_TABLE_SIZE
    # Adapter name -> lineage, the placement key's name (routing/keys.py): TRL's `{name}-v{N}`.
    lineage_pattern: str = DEFAULT_LINEAGE_PATTERN
    # Sessions named by X-Session-ID (routing/sessions.py): forgotten after this long unused,
    # and at most this many kept (the least recently used forgotten first).
    session_ttl: float = 1800.0
    max_sessions: int = 100_000
    # Weigh each replica's share of new families by its decode step, as its /metrics reports
    # it (fleet/pace.py; docs/design/routing.md#a-slow-replica-pace-and-weights).
    pace: bool = True

    # Timeouts (seconds)
    connect_timeout: float = 10.0
    first_byte_timeout: float = 1800.0
    idle_timeout: float = 1800.0
    fence_timeout: float = 600.0
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    upstream_idle_timeout: float = 30.0
    shutdown_grace: float = 30.0

    # Limits
    max_body_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_connections: int = field(default_factory=lambda: default_max_connections())
    # Request body bytes buffered at once over every client connection (503 beyond).
    max_buffered_bytes: int = 1 << 30
    max_prompt_tokens: int = 1_000_000
    max_upstream_connections: int = 1024  # per replica
    control_connections: int = 32  # per replica: the control session's (fleet/client.py)
    # Members at once, from --replicas, discovery and POST /router/replicas (Fleet.full).
    max_replicas: int = 1024
    retries: int = 2  # other replicas tried when nothing was received yet
    # Counted 5xx retries (made while most of the fleet fails, or onto a failing replica)
    # allowed below this share of the routed requests of the last 10 s (10 per 10 s always
    # are): see proxy/retry.py.
    retry_budget: float = 0.2

    # Adapter broadcasts
    load_retry_interval: float = 0.5
    load_deadline: float = 300.0
    # The longest a replica may take to answer one control call (pause, resume, unload, reset,
    # a listing, one load attempt): past it the replica is ejected (fleet/client.py).
    control_timeout: float = 60.0
    unload_stale: str | None = None
    unload_wait: float = 10.0  # an unload waits this long for requests admitted under the name
    down_replica_policy: str = "replay"  # replay | fail
    max_staleness: int = 4  # the trainer's max_staleness; --check wants max_loras >= it + 2

    # Health
    # /health answers 503 while fewer replicas are in service (1: while none is).
    min_replicas: int = 1
    health_interval: float = 2.0
    health_timeout: float = 2.0
    health_failures: int = 2
    health_successes: int = 2
    # A serving replica that computes nothing this long while the router holds requests on it
    # and the fleet is not paused is ejected as stalled (fleet/health.py); 0: never. Also the
    # bound on a gap in a stream under way once its replica left service (http/upstream.py).
    stall_timeout: float = 120.0
    breaker_failures: int = 5
    breaker_cooldown: float = 10.0
    # Replicas whose /metrics are read per health interval, round robin (fleet/telemetry.py):
    # bounds the scrapes' cost; each report is then at most ceil(replicas / it) intervals old.
    scrape_budget: int = 16

    # Visibility
    log_level: str = "info"
    status_interval: float = 60.0

    def __post_init__(self) -> None:
        """Refuse a setting the router cannot run with (ValueError naming the flag)."""
        first: dict[str, int] = {}
        for n, replica in enumerate(self.replicas, 1):
            if (seen := first.setdefault(replica.name, n)) != n:
                raise ValueError(
                    f"--replicas names {replica.name} twice (entries {seen} and {n}): one "
                    "server would take twice its share of requests and every adapter load "
                    "twice; list it once (URLs that differ only in the case of the scheme or "
                    "host, a default port, a trailing / or . and .. segments are one URL)"
                )
        if len(self.replicas) > self.max_replicas:
            raise ValueError(
                f"--replicas names {len(self.replicas)} replicas, over --max-replicas "
                f"{self.max_replicas}"
            )
        if self.discovering and not self.replica_hosts:
            raise ValueError(
                "discovery (--replicas-file/-dns/-srv) needs --replica-hosts: every member it "
                "finds gets the replicas' token, so name where they may be (such as 10.0.0.0/8 "
                "or *.cluster.local)"
            )
        for spec in self.replicas_dns:
            if not _host_port(spec):
                raise ValueError(f"--replicas-dns {spec!r}: expected NAME:PORT")
        if self.dns_server is not None and not _host_port(self.dns_server):
            raise ValueError(f"--dns-server {self.dns_server!r}: expected HOST:PORT")
        patterns = [HostPattern.parse(p) for p in self.replica_hosts]
        outside = [r.name for r in self.replicas if patterns and not self.replica_allowed(r)]
        if outside:
            raise ValueError(f"--replicas {outside[0]} is outside --replica-hosts")
        for path in self.forward_paths:
            error = forward_path_error(path)
            if error:
                raise ValueError(error)
        if not _is_loopback(self.host) and not self.api_key and not self.insecure_listen:
            raise ValueError(
                f"--host {self.host} is reachable beyond this machine: give --api-key-env NAME "
                "so clients must authenticate, or --insecure-listen"
            )
        if self.ca_file:
            if not os.path.isfile(self.ca_file):
                raise ValueError(f"--ca-file {self.ca_file}: no such file")
            try:
                ssl.create_default_context(cafile=self.ca_file)
            except (ssl.SSLError, ValueError, OSError):
                raise ValueError(
                    f"--ca-file {self.ca_file}: not a PEM bundle of CA certificates"
                ) from None
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be between 0 and 65535 (0: any free port)")
        for name in _SECONDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{_flag(name)} must be a positive number of seconds")
        for name in _SECONDS_OR_ZERO:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{_flag(name)} must be 0 or more seconds")
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"{_flag(name)} must be positive")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError("--block-size must be positive")
        for name in ("max_staleness", "retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be 0 or more")
        try:
            self.policy_params()
        except ParamError as exc:
            flag = _flag("affinity_table_size" if exc.param == "table_size" else exc.param)
            raise ValueError(f"{flag} {exc.rule}") from None
        if not (math.isfinite(self.retry_budget) and self.retry_budget >= 0):
            raise ValueError("--retry-budget must be a share of 0 or more (0.2: 20%)")
        try:
            Lineages(self.lineage_pattern)
        except ValueError as exc:
            raise ValueError(f"--lineage-pattern: {exc}") from None
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{_flag(name)} must be one of {', '.join(choices)}")
        if self.kv_events not in ("auto", "off"):
            for template in self.kv_events.split(","):
                if not template.startswith("tcp://") or "{host}" not in template:
                    raise ValueError(
                        f"--kv-events {self.kv_events!r}: expected auto, off, or "
                        "tcp://{host}:PORT[,tcp://{host}:REPLAY_PORT]"
                    )
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                "--max-buffered-bytes must be at least --max-body-bytes (one whole body)"
            )

    def policy_params(self) -> PolicyParams:
        """The routing policy's parameters from their flags (validated by PolicyParams)."""
        return PolicyParams(
            load_factor=self.load_factor,
            load_slack=self.load_slack,
            move_price=self.move_price,
            vnodes=self.vnodes,
            table_size=self.affinity_table_size,
        )

    @property
    def discovering(self) -> bool:
        """Whether members also come from discovery sources (fleet/discovery.py)."""
        return bool(self.replicas_files or self.replicas_dns or self.replicas_srv)

    def replica_allowed(self, address: ReplicaAddress) -> bool:
        """Whether the token may go to `address`: every replica joins through this check. With
        `--replica-hosts`, its patterns decide; without, only the `--replicas` themselves
        (scheme, host and port: any local process can listen on another port of a loopback
        replica's host, and an https replica is never reached as http)."""
        if not self.replica_hosts:
            endpoint = (address.scheme, address.host, address.port)
            return any((r.scheme, r.host, r.port) == endpoint for r in self.replicas)
        return any(p.matches(address) for p in _host_patterns(self.replica_hosts))

    def cleartext_token(self, address: ReplicaAddress) -> bool:
        """Whether the token would cross a network in the clear to reach `address`."""
        return bool(self.token) and not address.tls and not _is_loopback(address.host)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context for https replicas (system store, plus --ca-file)."""
        if not any(r.tls for r in self.replicas):
            return None
        return self.tls_context()

    def tls_context(self) -> ssl.SSLContext:
        """A client TLS context whatever the replicas (for https replicas added at run time)."""
        ctx = ssl.create_default_context()
        if self.ca_file:
            ctx.load_verify_locations(cafile=self.ca_file)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


_SECONDS = (
    "dns_interval",
    "connect_timeout",
    "first_byte_timeout",
    "idle_timeout",
    "fence_timeout",
    "header_timeout",
    "body_timeout",
    "keepalive_timeout",
    "upstream_idle_timeout",
    "load_retry_interval",
    "load_deadline",
    "control_timeout",
    "health_interval",
    "health_timeout",
    "breaker_cooldown",
    "session_ttl",
)
_SECONDS_OR_ZERO = (
    "shutdown_grace",
    "status_interval",
    "unload_wait",
    "discovery_grace",
    "stall_timeout",
)
_POSITIVE = (
    "max_body_bytes",
    "max_header_bytes",
    "max_headers",
    "max_connections",
    "max_buffered_bytes",
    "max_prompt_tokens",
    "max_upstream_connections",
    "control_connections",
    "max_replicas",
    "health_failures",
    "health_successes",
    "min_replicas",
    "breaker_failures",
    "scrape_budget",
    "max_sessions",
)
_CHOICES = {
    "policy": POLICIES,
    "down_replica_policy": ("replay", "fail"),
    "log_level": ("debug", "info", "warning", "error"),
}


FD_RESERVE = 256  # descriptors kept for the rest: control connections, KV sockets, files
MAX_CONNECTIONS_CAP = 10_000


def default_max_connections() -> int:
    """`--max-connections` when not given: `MAX_CONNECTIONS_CAP`, or less where the soft
    RLIMIT_NOFILE would run out first: half of what is left after `FD_RESERVE` (each client
    connection may hold an upstream connection too), at least 1."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    return max(1, min(MAX_CONNECTIONS_CAP, (soft - FD_RESERVE) // 2))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _host_port(spec: str) -> bool:
    host, _, port = spec.rpartition(":")
    return bool(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536


_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?", re.IGNORECASE)
# A last label like these makes the resolver read the name as an IPv4 address (127.1, 0x7f.1).
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*", re.IGNORECASE)
_IP_GLOB = re.compile(r"[0-9.*?\[\]!-]+")  # `10.0.0.*`: written like an IPv4 address
_DIGIT = re.compile(r"[0-9]")


def _dns_name(host: str) -> bool:
    """Whether `host` is a DNS name as RFC 1123 writes one (`_` allowed, as in SRV targets),
    whose last label is not a number: never an address in a form `ipaddress` does not read."""
    labels = host.removesuffix(".").split(".")
    return (
        len(host) <= 253
        and all(_LABEL.fullmatch(label) for label in labels)
        and not _NUMERIC_LABEL.fullmatch(labels[-1])
    )


def _path_prefix(path: str) -> str:
    """A URL's path as a replica's prefix: its `.` and `..` segments resolved (RFC 3986, 5.2.4)
    and no trailing `/` ("" for the root)."""
    segments: list[str] = []
    for segment in path.split("/")[1:]:
        if segment == "..":
            if segments:
                segments.pop()
        elif segment != ".":
            segments.append(segment)
    return "".join("/" + s for s in segments).rstrip("/")


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
