"""Socket activation, the child's side: a process serves HTTP on a listening socket its parent bound (stdlib only).

Two children of ``supervise serve`` take one: rank 0 of the built-in engine
(engine/app.py) and the relay (supervisor/relay/main.py).  The parent's side,
which binds the socket and names it in the child's environment, is
supervisor/processes/listen_socket.py; the variables are defined here, once.

A parent that binds the port once and hands the socket to every attempt of
the engine keeps the port alive across a restart: while no engine runs,
connections wait in the socket's backlog instead of being refused.

Two ways to hand it over, checked in this order:

1. systemd's convention (``sd_listen_fds(3)``): ``LISTEN_PID`` is this
   process's pid and ``LISTEN_FDS`` >= 1: fd 3 (``SD_LISTEN_FDS_START``) is
   the socket (further fds are made close-on-exec and left alone).
   ``LISTEN_PID`` naming another process means the variables were meant for
   someone else: ignored, as systemd does.
2. ``SUPERVISE_LISTEN_FDS=<fd>``: the number of the inherited fd, for a
   parent that cannot know the child's pid before it runs (``subprocess``
   with ``pass_fds=(fd,)`` keeps the parent's fd number; it cannot set
   ``LISTEN_PID`` between fork and exec as systemd does).

The fd must be a listening ``SOCK_STREAM`` socket of family ``AF_INET`` or
``AF_INET6``; anything else is a startup error naming the variable (the
engine never falls back to binding ``--host``/``--port`` when it was given a
socket).  Every rank removes ``LISTEN_PID``, ``LISTEN_FDS``,
``LISTEN_FDNAMES`` and ``SUPERVISE_LISTEN_FDS`` from its environment at start
(children never inherit them); only rank 0 uses the socket, and makes its fd
close-on-exec.

The engine owns its copy of the fd and closes it when it stops accepting
(a group failure, a shutdown) or exits; it never calls ``shutdown()`` on it,
so the parent's copy keeps the socket listening.  asyncio calls
``listen()`` again on a socket it serves: the engine passes
:func:`~tp_supervise.supervisor.rank.net.listen_backlog` (the kernel's ``net.core.somaxconn``, the largest
backlog the kernel grants), so a parent that bound with that backlog sees
it unchanged.  asyncio also puts the socket (the open file description,
shared with the parent's copy) in non-blocking mode.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable, MutableMapping

from .net import is_loopback

SD_LISTEN_FDS_START = 3
LISTEN_PID = "LISTEN_PID"
LISTEN_FDS = "LISTEN_FDS"
LISTEN_FDNAMES = "LISTEN_FDNAMES"
SUPERVISE_LISTEN_FDS = "SUPERVISE_LISTEN_FDS"
# Set for the built-in engine's rank 0 when a relay holds the public port: the URL clients use, which its ready
# line names (rank 0 itself serves a loopback port behind the relay).
RELAY_URL_ENV = "SUPERVISE_RELAY_URL"
VARIABLES = (LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES, SUPERVISE_LISTEN_FDS)
FAMILIES = (socket.AF_INET, socket.AF_INET6)


class ListenError(RuntimeError):
    """The inherited socket named by the environment cannot be used."""


def _integer(environ, name: str) -> int:
    text = environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ListenError(f"{name}={text[:40]!r} is not an integer") from None


def inherited_fd(environ, pid: int) -> tuple[int, int, str] | None:
    """(fd, count, variable) named by the environment for process ``pid``, or None (pure)."""
    if environ.get(LISTEN_PID) is not None and _integer(environ, LISTEN_PID) == pid:
        count = _integer(environ, LISTEN_FDS) if environ.get(LISTEN_FDS) else 0
        if count >= 1:
            return SD_LISTEN_FDS_START, count, LISTEN_FDS
    if environ.get(SUPERVISE_LISTEN_FDS):
        fd = _integer(environ, SUPERVISE_LISTEN_FDS)
        if fd < SD_LISTEN_FDS_START:
            raise ListenError(f"{SUPERVISE_LISTEN_FDS}={fd}: fds 0-2 are stdin, stdout and stderr")
        return fd, 1, SUPERVISE_LISTEN_FDS
    return None


def _socket(fd: int, variable: str) -> socket.socket:
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise ListenError(f"fd {fd} (from {variable}) is not open: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"fd {fd} (from {variable}) is not a socket")
    sock = socket.socket(fileno=fd)
    try:
        if sock.family not in FAMILIES or sock.type != socket.SOCK_STREAM:
            raise ListenError(f"fd {fd} (from {variable}) is not a TCP socket ({sock.family!r}, {sock.type!r})")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ListenError(f"fd {fd} (from {variable}) is a socket that is not listening")
    except BaseException:
        sock.detach()  # not ours to close: the parent passed something else
        raise
    sock.set_inheritable(False)
    return sock


def take_listen_socket(environ: MutableMapping[str, str], pid: int, use: bool) -> socket.socket | None:
    """Remove the variables from ``environ``; when ``use``, return the socket they name (or None).

    Raises :class:`ListenError` when a variable is malformed or the fd is no listening TCP socket.
    """
    try:
        found = inherited_fd(environ, pid) if use else None
    finally:
        for name in VARIABLES:
            environ.pop(name, None)
    if found is None:
        return None
    fd, count, variable = found
    for extra in range(fd + 1, fd + count):
        try:
            os.set_inheritable(extra, False)
        except OSError:
            pass
    return _socket(fd, variable)


def warn_if_exposed(host: str, port: int, warn: Callable[..., None]) -> None:
    """The completions API has no authentication: say so once (``warn(event, **fields)``, the caller's logger)
    when it listens beyond loopback."""
    if not is_loopback(host):
        warn(
            "the completions API has no authentication and binds a non-loopback address; "
            "put it behind an authenticating proxy or bind 127.0.0.1",
            host=host,
            port=port,
        )
