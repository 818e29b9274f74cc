"""The serving port, bound once by the supervisor and inherited by rank 0 in every attempt (socket activation).

A restart of the group closes every rank's sockets; if the engine bound its
own port, clients would meet "connection refused" until the next attempt
listens.  Instead the supervisor binds the port before the first attempt and
keeps it open for the whole run; rank 0 of each attempt inherits it and
accepts on it.  Between attempts the kernel completes handshakes and queues
connections in the socket's backlog (``net.core.somaxconn``, the most the
kernel grants); the next engine answers them.  Past the backlog the kernel
drops new SYNs (``tcp_abort_on_overflow`` 0), so a client retransmits rather
than being refused.

Two ways to hand it to the rank (docs/engine.md, "Socket activation"; the child's side, and the one
definition of the variables: supervisor/rank/listen.py)::

    built-in engine   SUPERVISE_LISTEN_FDS=<fd>        the fd keeps the supervisor's number (pass_fds)
    --listen          LISTEN_FDS=1, LISTEN_PID=<pid>   systemd's sd_listen_fds(3): the socket is fd 3,
                      LISTEN_FDNAMES=supervise         LISTEN_PID the rank's own pid

``LISTEN_PID`` can only be known in the child: the rank is started through
``/bin/sh -c`` (``SHIM``), which exports its own pid, moves the socket to fd 3
and ``exec``\\ s the command, so the command runs with the pid the variable
names.  Only rank 0 gets the socket; the supervisor never accepts on it.
"""

from __future__ import annotations

import errno
import os
import socket

from ..rank.listen import LISTEN_FDNAMES, LISTEN_FDS, LISTEN_PID, SD_LISTEN_FDS_START, SUPERVISE_LISTEN_FDS
from ..rank.net import listen_backlog
from ..spec import UsageError

FD_NAME = "supervise"
# $1: the socket's fd in the child; the command follows.  sh keeps its pid across exec.
SHIM = 'export LISTEN_PID=$$; if [ "$1" != 3 ]; then eval "exec 3<&$1 $1<&-" || exit 127; fi; shift; exec "$@"'


class ListenSocket:
    """One listening TCP socket, owned by the supervisor for the whole run (``close()`` at its end)."""

    def __init__(self, sock: socket.socket, flag: str, systemd: bool):
        self.sock = sock
        self.flag = flag
        self.systemd = systemd
        self.backlog = listen_backlog()

    @classmethod
    def bind(cls, host: str, port: int, flag: str, systemd: bool = False) -> ListenSocket:
        """Bind and listen (port 0: a free port), or raise ``UsageError`` naming ``flag``."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host.strip("[]"), port), family=family, backlog=listen_backlog())
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"{flag}: port {port} on {host} is already in use; stop what holds it or pick another port"
                ) from None
            raise UsageError(f"{flag}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        sock.set_inheritable(False)  # only rank 0 gets it, through pass_fds
        return cls(reserve_fd3(sock) if systemd else sock, flag, systemd)

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def hand_to(
        self, argv: tuple[str, ...], env: dict[str, str], keep: tuple[int, ...] = ()
    ) -> tuple[tuple[str, ...], dict[str, str], tuple[int, ...]]:
        """Rank 0's argv, environment and fds to pass, with the socket.  ``keep``: the other fds the child keeps at
        their numbers (the death pipe); systemd's fd 3 must not be one of them."""
        fd = self.fd
        if not self.systemd:
            return argv, dict(env, **{SUPERVISE_LISTEN_FDS: str(fd)}), (fd,)
        if fd != SD_LISTEN_FDS_START and SD_LISTEN_FDS_START in keep:
            raise RuntimeError(f"{self.flag}: the ranks' fd 3 is taken (the death pipe): the socket cannot be fd 3")
        env = dict(env, **{LISTEN_FDS: "1", LISTEN_FDNAMES: FD_NAME})
        env.pop(LISTEN_PID, None)  # the shim sets it to the rank's own pid
        return ("/bin/sh", "-c", SHIM, "supervise-listen", str(fd), *argv), env, (fd,)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> ListenSocket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reserve_fd3(sock: socket.socket) -> socket.socket:
    """systemd style: move a freshly bound socket to fd 3 when that fd is free, so no other fd the ranks keep
    (the death pipe, opened later) can take it; the child's shim then needs no dup."""
    if sock.fileno() == SD_LISTEN_FDS_START:
        return sock
    try:
        os.fstat(SD_LISTEN_FDS_START)
        return sock  # taken (inherited from our parent): the shim moves the socket in the child
    except OSError:
        pass
    os.dup2(sock.fileno(), SD_LISTEN_FDS_START, inheritable=False)
    moved = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.close()
    return moved
