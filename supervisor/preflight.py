"""Checks of the world before anything is started: the executable, the dump directory, GPUs, ports.

Each failure is a ``UsageError`` (exit 64) that says what to change.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tp_supervise.dumps.bundle import make_dirs

from .spec import UsageError

if TYPE_CHECKING:
    from .spec import LaunchSpec


def preflight(spec: LaunchSpec) -> None:
    _check_torch(spec)
    _check_command(spec)
    _check_dump_dir(spec.dumps.dir)
    if spec.output.log_dir is not None:
        _check_dump_dir(spec.output.log_dir, "--log-dir")
    _check_gpus(spec)
    textfile = spec.metrics.textfile
    if textfile is not None and not textfile.parent.is_dir():
        raise UsageError(
            f"--metrics-textfile {textfile}: its directory does not exist "
            "(point it into node_exporter's --collector.textfile.directory)"
        )
    if spec.metrics.addr is not None and spec.metrics.addr[1] != 0:
        _check_port_free(spec.metrics.addr[0], spec.metrics.addr[1], "--metrics-addr")
    if spec.metrics.health_addr is not None:
        if (
            spec.metrics.health_addr[1] != 0
            and spec.metrics.addr is not None
            and spec.metrics.health_addr[1] == spec.metrics.addr[1]
        ):
            raise UsageError(
                f"--health-addr port {spec.metrics.health_addr[1]} is --metrics-addr's: give another port "
                "(or leave --health-addr out: health is served on --metrics-addr too)"
            )
        if spec.metrics.health_addr[1] != 0:
            _check_port_free(spec.metrics.health_addr[0], spec.metrics.health_addr[1], "--health-addr")
    if spec.nnodes == 1 and not _is_local(spec.master_addr):
        raise UsageError(
            f"--master-addr {spec.master_addr} is not an address of this host: with one node the ranks "
            "meet here; leave it out, or give this host's address"
        )
    if spec.node_rank == 0 and spec.master_port is not None and _is_local(spec.master_addr):
        _check_port_free(spec.master_addr, spec.master_port, "--master-port")
        # --store-port is bound by node 0's gate itself, which, finding it taken, says by whom (another node 0
        # of this group, or something else): nodes/transport.py
    # The engine's --port (and --listen) are bound for the run by the CLI right after these checks (a taken port is a
    # usage error there): supervisor/processes/listen_socket.py


ENGINE_MODULES = ("torch", "safetensors", "tokenizers")  # pyproject.toml's `engine` extra


def missing_engine_modules() -> list[str]:
    """What the built-in engine imports and this python lacks (its ranks run in this python)."""
    return [name for name in ENGINE_MODULES if importlib.util.find_spec(name) is None]


def builtin_engine_error() -> str | None:
    missing = missing_engine_modules()
    if not missing:
        return None
    return (
        f"the built-in engine needs {', '.join(missing)}, which {sys.executable} does not have: "
        "pip install 'tp-supervise[engine]' (or give your engine's COMMAND after --)"
    )


def _check_torch(spec: LaunchSpec) -> None:
    """tp-supervise installs no torch (an engine's environment pins its own): the two runs that use one in this
    python are refused here, before anything starts, rather than failing in a rank or a store child."""
    if spec.builtin:
        error = builtin_engine_error()
        if error is not None:
            raise UsageError(error)
    if spec.nnodes > 1 and importlib.util.find_spec("torch") is None:
        raise UsageError(
            f"--nnodes {spec.nnodes}: the node supervisors share torch.distributed's TCPStore, and {sys.executable} "
            "has no torch: install tp-supervise into the engine's environment (or pip install 'tp-supervise[engine]')"
        )


def _check_command(spec: LaunchSpec) -> None:
    if spec.builtin:
        return
    exe = spec.command[0]
    if os.sep in exe:
        path = Path(exe)
        if not path.exists():
            raise UsageError(f"command {exe!r} does not exist; check the path after '--'")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise UsageError(f"command {exe!r} is not executable; chmod +x it or run it through its interpreter")
        return
    if shutil.which(exe) is None:
        raise UsageError(f"command {exe!r} was not found on PATH; check the spelling or give its full path")


def _check_dump_dir(path: Path, flag: str = "--dump-dir") -> None:
    try:
        make_dirs(path)  # new directories 0750: bundles hold stderr tails and command lines
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UsageError(
            f"{flag} {str(path)!r} is not writable ({exc.strerror or exc}); choose a directory you can write"
        ) from None


def visible_gpu_count() -> int | None:
    """GPUs this node can use: CUDA_VISIBLE_DEVICES when set, else NVML's count."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def _check_gpus(spec: LaunchSpec) -> None:
    if not spec.builtin or spec.engine.device != "cuda":
        return
    count = visible_gpu_count() or 0
    if spec.nproc_per_node > count:
        raise UsageError(
            f"--nproc-per-node {spec.nproc_per_node} ranks with --device cuda, but this node has {count} visible "
            "GPU(s): lower --tp / --nproc-per-node, spread the world over more nodes with --nnodes, "
            "or run on the CPU with --device cpu"
        )


def _is_local(host: str) -> bool:
    if host in ("localhost", "0.0.0.0", "::", "::1") or host.startswith("127."):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _check_port_free(host: str, port: int, flag: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"{flag}: port {port} on {host} is already in use; stop what holds it or pick another port"
                ) from None
            raise UsageError(f"{flag}: cannot bind {host}:{port} ({exc.strerror or exc})") from None
