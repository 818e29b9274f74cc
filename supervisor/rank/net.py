"""Socket helpers both sides need (stdlib only): a free TCP port, whether a host is loopback, the listen backlog."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the caller binds it soon after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """True when ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"


def listen_backlog() -> int:
    """The kernel's ``net.core.somaxconn``: ``listen()`` silently caps any larger backlog at it."""
    try:
        with open(SOMAXCONN_PATH) as f:
            return max(1, int(f.read().strip()))
    except (OSError, ValueError):
        return socket.SOMAXCONN
