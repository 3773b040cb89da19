"""Host names as a server checks them: the ``Host`` and ``Origin`` headers parsed
(:func:`parse_host`, :func:`parse_origin`), loopback names told apart, and the hosts a server
allows (``--allowed-hosts``; a server bound to a loopback address allows only loopback names,
so that a DNS-rebinding page cannot reach it).  :mod:`guard` applies them to every request."""

from __future__ import annotations

import ipaddress
import re
import socket

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")

_NAME = re.compile(r"[A-Za-z0-9._~-]+")  # a DNS name or an IPv4 address, as Host spells it
_PORT = re.compile(r"[0-9]{0,5}")
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(.*)", re.DOTALL)


def parse_host(authority: str) -> str | None:
    """The host of an HTTP ``Host`` value (``host[:port]``: a name, an IPv4 address or a
    bracketed IPv6 address, then an optional port), lower-cased, an IP address in its
    canonical form (``[0::1]:80`` -> ``::1``); None when ``authority`` is not of that shape
    (``a@127.0.0.1``, ``localhost/x``, ``localhost:abc``, ``[::1``)."""
    if authority.startswith("["):
        host, bracket, port = authority[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            return None
        port = port[1:]
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            return None
    else:
        host, _, port = authority.partition(":")
        if not _NAME.fullmatch(host):
            return None
        host = _canonical(host)
    if not _PORT.fullmatch(port) or (port and int(port) > 65535):
        return None
    return host


def parse_origin(origin: str) -> str | None:
    """The host of an ``Origin`` value (``scheme://host[:port]``), "" for ``null`` (an opaque
    origin: a sandboxed page, a file), None when malformed."""
    if origin == "null":
        return ""
    match = _ORIGIN.fullmatch(origin)
    return None if match is None else parse_host(match.group(1))


def _canonical(host: str) -> str:
    """A host name lower-cased, an IP address in its canonical form."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` listens on a loopback address only: the address
    the bind resolves ``host`` to, however it is spelt (``127.1``, ``0x7f.1``, any address in
    127.0.0.0/8, ``::1``, ``localhost``, a name for one of them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as the bind picks it
    try:
        address = socket.getaddrinfo(host.strip("[]"), None, family, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):  # it cannot be bound either: keep the allow-list
        return True
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The hosts a server bound to ``bind_host`` answers by default: loopback names (and the
    bind address as given) when it is bound to a loopback address, else any (None)."""
    if not is_loopback(bind_host):
        return None
    return sorted({*LOOPBACK_NAMES, _canonical(bind_host.strip("[]"))})


def check_allowed_hosts(hosts: list[str]) -> set[str] | None:
    """An allow-list as the guard compares it (None: any host); ValueError naming an entry
    that is no host name or address, or an empty list (which would refuse every request)."""
    if "*" in hosts:
        return None
    if not hosts:
        raise ValueError("--allowed-hosts names no host, so every request would be refused; "
                         "give host names separated by commas, or '*' for any")
    allowed = set()
    for entry in hosts:
        host = parse_host(entry if ":" not in entry or entry.startswith("[")
                          else f"[{entry}]")  # a bare IPv6 address
        if host is None or entry.endswith(":"):
            raise ValueError(f"--allowed-hosts entry {entry!r} is not a host name or address "
                             "(give names like example.com, 10.0.0.5 or ::1, no port or path)")
        allowed.add(host)
    return allowed
