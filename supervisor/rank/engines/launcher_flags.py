"""What a tree-mode launcher's own command line says: which engine, how many ranks here, its multi-node launch,
and the job every node must run alike.

Pure functions of the command (``engine_versions`` aside: it asks the launcher's own interpreter, with a
deadline).  What each engine's flags are called lives in its module (``vllm.py``,
``sglang.py`` beside this one); the rules are docs/multinode.md, "An engine's own multi-node launch".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import BY_NAME, ENGINES, flag_value


class LaunchFlagError(ValueError):
    """A launcher flag this module reads holds something it cannot be (the caller makes it a usage error)."""


def _switch(command: Sequence[str], flags: Sequence[str]) -> str | None:
    """A boolean flag: "true" given, "false" given as ``--no-<flag>``, its value when written ``--flag=V``,
    None when absent."""
    for arg in command:
        flag, eq, value = arg.partition("=")
        if flag in flags:
            return value if eq else "true"
        if flag.startswith("--no-") and f"--{flag[5:]}" in flags:
            return "false"
    return None


def launcher_engine(command: Sequence[str]) -> str | None:
    """The engine (its module's ``NAME``: "vllm", "sglang") whose launcher the tree-mode command is, else None:
    one of its ``LAUNCHER_WORDS`` anywhere in the command (a wrapper before it, env, numactl, taskset, changes
    nothing), or its ``CLI`` (``vllm serve``)."""
    return _engine_at(command)[0]


def compiles_model(command: Sequence[str]) -> str:
    """Why the engine ``command`` launches runs its model compiled (torch.compile), in words; "" when it runs
    eagerly or is no engine we know.  The collectives inside a compiled model run in its graph, without Python
    (docs/watchdogs.md, "Engine modes")."""
    name = launcher_engine(command)
    if name is None:
        return ""
    engine = BY_NAME[name]
    words = [w.partition("=")[0] for w in command]
    if engine.COMPILES_BY_DEFAULT and not any(flag in words for flag in engine.EAGER_FLAGS):
        return f"{name} compiles its model by default (no {' / '.join(engine.EAGER_FLAGS)})"
    given = [flag for flag in engine.COMPILE_FLAGS if flag in words]
    return f"{name} compiles its model ({given[0]})" if given else ""


def _engine_at(command: Sequence[str]) -> tuple[str | None, int]:
    """(engine, index of the word after its launcher words) or (None, -1)."""
    for i, arg in enumerate(command):
        name = os.path.basename(arg)
        for engine in ENGINES:
            cli = engine.CLI
            if cli and name == cli[0] and tuple(command[i + 1 : i + len(cli)]) == cli[1:]:
                return engine.NAME, i + len(cli)
            if arg in engine.LAUNCHER_WORDS or name in engine.LAUNCHER_WORDS:
                after = i + 1
                # vLLM's CLI module: `python -m vllm.entrypoints.cli.main serve MODEL`
                if cli and after < len(command) and command[after] == cli[-1]:
                    after += 1
                return engine.NAME, after
    return None, -1


def _int(command: Sequence[str], flags: Sequence[str], default: int | None = None) -> int | None:
    text = flag_value(command, flags)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise LaunchFlagError(f"the launcher's {flags[0]} {text!r} is not a number") from None


@dataclass(frozen=True)
class EngineLaunch:
    """An engine launcher's own multi-node launch, as its flags say it (defaults filled in)."""

    engine: str
    world: int  # ranks of the whole job (tensor x pipeline x data parallel)
    nnodes: int
    node_rank: int
    rendezvous: tuple[str, int] | None  # node 0's torch.distributed rendezvous, None: not given (single node)
    rendezvous_span: int  # ports the engine takes from the rendezvous port up
    headless: bool  # no API server on this node (a node > 0, or --headless)

    @property
    def nproc_per_node(self) -> int:
        return max(1, self.world // self.nnodes)


def engine_launch(command: Sequence[str]) -> EngineLaunch | None:
    """The multi-node launch of a vLLM or SGLang launcher (None for any other command).  Raises
    ``LaunchFlagError`` for values that cannot be (the engine would refuse them too, later and less clearly)."""
    name = launcher_engine(command)
    if name is None:
        return None
    e = BY_NAME[name]
    tp = _int(command, e.TP_FLAGS, 1) or 1
    pp = _int(command, e.PP_FLAGS, 1) or 1
    dp = (_int(command, e.DP_FLAGS, 1) or 1) if e.DP_FLAGS else 1
    nnodes = _int(command, e.NNODES_FLAGS, 1) or 1
    node_rank = _int(command, e.NODE_RANK_FLAGS, 0) or 0
    world = tp * pp * dp
    if nnodes < 1 or world < 1:
        raise LaunchFlagError(f"the launcher's sizes must be at least 1 (world {world}, {e.NNODES_FLAGS[0]} {nnodes})")
    if world % nnodes:
        raise LaunchFlagError(
            f"the launcher's {e.NNODES_FLAGS[0]} {nnodes} does not divide its world of {world} ranks "
            f"({e.TP_FLAGS[0]} {tp} x {e.PP_FLAGS[0]} {pp}" + (f" x {e.DP_FLAGS[0]} {dp})" if e.DP_FLAGS else ")")
        )
    if not 0 <= node_rank < nnodes:
        raise LaunchFlagError(
            f"the launcher's {e.NODE_RANK_FLAGS[0]} {node_rank} is outside 0..{nnodes - 1} for "
            f"{e.NNODES_FLAGS[0]} {nnodes}"
        )
    rendezvous: tuple[str, int] | None = None
    if e.DIST_INIT_FLAGS:
        text = flag_value(command, e.DIST_INIT_FLAGS)
        if text is not None:
            host, sep, digits = text.rpartition(":")
            if not sep or not digits.isdigit() or not host:
                raise LaunchFlagError(f"the launcher's {e.DIST_INIT_FLAGS[0]} {text!r}: expected HOST:PORT")
            rendezvous = (host.strip("[]"), int(digits))
    elif nnodes > 1 or flag_value(command, e.MASTER_ADDR_FLAGS) is not None:
        default_host, default_port = e.DEFAULT_MASTER
        port = _int(command, e.MASTER_PORT_FLAGS, default_port)
        rendezvous = (flag_value(command, e.MASTER_ADDR_FLAGS) or default_host, default_port if port is None else port)
    if rendezvous is not None and not 1 <= rendezvous[1] <= 65535:
        raise LaunchFlagError(f"the launcher's rendezvous port {rendezvous[1]} is not between 1 and 65535")
    if nnodes > 1 and rendezvous is None:
        raise LaunchFlagError(
            f"the launcher has {e.NNODES_FLAGS[0]} {nnodes} but no {e.DIST_INIT_FLAGS[0]} HOST:PORT: its nodes "
            "would never meet; give node 0's address on every node"
        )
    headless = node_rank > 0 or any(flag in command for flag in e.NO_API_FLAGS)
    return EngineLaunch(name, world, nnodes, node_rank, rendezvous, e.RENDEZVOUS_SPAN, headless)


def launcher_nproc(command: Sequence[str]) -> str | None:
    """Ranks per node as the tree-mode launcher's own arguments say it (``--flag N`` or ``--flag=N``):
    torchrun's ``--nproc-per-node``, or an engine's world (tensor x pipeline x data parallel) over its nodes."""
    try:
        launch = engine_launch(command)
    except LaunchFlagError:
        launch = None
    if launch is not None:
        return str(launch.nproc_per_node)
    return flag_value(command, ("--nproc-per-node", "--nproc_per_node"))


def launcher_metrics_url(command: Sequence[str]) -> str | None:
    """The engine's own /metrics, from the launcher's ``--host``/``--port`` (or the engine's defaults).

    A listener on every address (0.0.0.0, ::, none given) is scraped on loopback.
    """
    engine = launcher_engine(command)
    if engine is None:
        return None
    port_text = flag_value(command, ("--port",))
    try:
        port = int(port_text) if port_text is not None else BY_NAME[engine].DEFAULT_PORT
    except ValueError:
        return None
    host = flag_value(command, ("--host",)) or ""
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


DEFAULT = "(default)"
CONFIG_DIGEST_BYTES = 1 << 20  # a --config file beyond this is compared by its first MiB and its size


def _model(command: Sequence[str], e: ModuleType, after: int) -> str | None:
    given = flag_value(command, e.MODEL_FLAGS)
    if given is None and 0 <= after < len(command) and not command[after].startswith("-"):
        given = command[after]  # `vllm serve MODEL`
    return given


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(CONFIG_DIGEST_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return f"sha256:{hashlib.sha256(head).hexdigest()[:16]} ({size} bytes)"


def job_fields(command: Sequence[str]) -> dict[str, str] | None:
    """What an engine's job is, field by field (the engine's ``JOB_FLAGS``; absent: "(default)"), for the
    cross-node comparison; None for a command that is no engine launcher.  A local model directory adds the
    digest of its config.json (the same path holding another model is caught too); a --config file, its
    content's digest."""
    name, after = _engine_at(command)
    if name is None:
        return None
    e = BY_NAME[name]
    out: dict[str, str] = {"engine": name}
    for field_name, flags in e.JOB_FLAGS.items():
        if field_name == "model":
            value = _model(command, e, after)
        else:
            value = flag_value(command, flags)
            switch = _switch(command, flags)
            if switch is not None and (value is None or value.startswith("-") or switch == "false"):
                value = switch
            elif value is not None and value.startswith("-"):
                value = "true"  # a switch followed by the next flag
        out[field_name] = DEFAULT if value is None else value
    model = out.get("model", DEFAULT)
    if model != DEFAULT and Path(model, "config.json").is_file():
        out["model_config"] = _file_digest(str(Path(model, "config.json")))
    config = flag_value(command, e.CONFIG_FLAGS)
    if config is not None:
        out["config_file"] = _file_digest(config)
    return out


_VERSIONS_SCRIPT = """
import json, sys
from importlib import metadata
out = {}
for names in json.loads(sys.argv[1]):
    for name in names:
        try:
            out[names[0]] = name + " " + metadata.version(name)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        out[names[0]] = "absent"
print(json.dumps(out))
"""
VERSIONS_TIMEOUT_S = 15.0


def launcher_python(command: Sequence[str]) -> str | None:
    """The interpreter the launcher runs in: the command's python, else the one its script's ``#!`` names
    (``vllm serve``)."""
    for arg in command:
        base = os.path.basename(arg)
        if base.startswith("python") and not base.endswith((".py", ".pyc")):
            return arg
    scripts = {e.CLI[0] for e in ENGINES if e.CLI}
    script = next((shutil.which(arg) for arg in command if os.path.basename(arg) in scripts), None)
    if script is None:
        return None
    try:
        with open(script, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    words = first[2:].decode("utf-8", "replace").split() if first.startswith(b"#!") else []
    pythons = [w for w in words if os.path.basename(w).startswith("python")]  # `#!/usr/bin/env python3` too
    return pythons[0] if pythons else None


def engine_versions(
    command: Sequence[str], environ: Mapping[str, str], timeout_s: float = VERSIONS_TIMEOUT_S
) -> dict[str, str]:
    """The engine's and torch's versions where the launcher runs (its interpreter, its environment: a
    PYTHONPATH that shadows a package counts): ``{"vllm": "vllm 0.32.0+cpu", "torch": "torch 2.13.0"}``; a
    value says "unknown (...)" when the interpreter cannot be found or does not answer within ``timeout_s``."""
    name = launcher_engine(command)
    if name is None:
        return {}
    asked = [list(BY_NAME[name].DISTRIBUTIONS), ["torch"]]
    keys = [names[0] for names in asked]
    python = launcher_python(command)
    if python is None:
        return {key: "unknown (the launcher's python was not found)" for key in keys}
    try:
        out = subprocess.run(
            [python, "-c", _VERSIONS_SCRIPT, json.dumps(asked)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(environ),
            stdin=subprocess.DEVNULL,
        )
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {key: f"unknown ({type(exc).__name__})" for key in keys}
    if not isinstance(found, dict):
        return {key: f"unknown ({python} exited {out.returncode})" for key in keys}
    return {key: str(found.get(key, "absent"))[:120] for key in keys}
