"""The deployment recipe (docs/deploy.md) cannot drift from the code: the LeaderWorkerSet manifest is valid
against the LWS CRD's schema, its `supervise serve` line and the two-host script's are accepted by our own CLI
parser for every node, the probes hit paths that command line really serves, and the grace period covers the
teardown the parsed flags allow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tp_supervise.supervisor.nodes import link
from tp_supervise.supervisor.cli import build_parser, spec_from_args
from tp_supervise.supervisor.rank.engines.launcher_flags import job_fields
from tp_supervise.supervisor.observers.http_server import HealthCell, HealthServer, HealthStatus
from tp_supervise.supervisor.observers.metrics import SupervisorMetrics
from tp_supervise.supervisor.spec import DEFAULT_FAULT_LINGER_S, LaunchSpec
from tp_supervise.supervisor.state import EngineState

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "docs" / "deploy"
LWS_MANIFEST = DEPLOY / "lws.yaml"
LWS_VLLM = DEPLOY / "lws-vllm.yaml"  # vLLM's own multi-node launch: a leader line and a headless workers' line
MANIFESTS = pytest.mark.parametrize("manifest", [LWS_MANIFEST, LWS_VLLM], ids=["lws", "lws-vllm"])
TWO_HOSTS = DEPLOY / "two-hosts.sh"
LWS_SCHEMA = REPO / "tests" / "data" / "lws-v1-crd-schema.json"  # vendored from kubernetes-sigs/lws; see _source
PROBE_PATHS = {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/livez"}
SCRIPT_TIMEOUT_S = 30
_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")

# -- a structural validator for the subset of OpenAPI v3 that CRD schemas use ---------------------------------


def schema_errors(value, schema: dict, path: str = "") -> list[str]:
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, (int, str)) and not isinstance(value, bool) else [f"{path}: int or string"]
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return []
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in checks and not isinstance(value, checks[kind]):
        return [f"{path}: expected {kind}, got {type(value).__name__}"]
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return [f"{path}: expected integer, got {value!r}"]
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return [f"{path}: expected number, got {value!r}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < minimum {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if kind == "array":
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: required field {key!r} missing")
        for key, item in value.items():
            if props is not None and key in props:
                errors += schema_errors(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}: unknown field {key!r}")
    return errors


def lws_schema() -> dict:
    data = json.loads(LWS_SCHEMA.read_text())
    schema = data["openAPIV3Schema"]
    template = schema["properties"]["spec"]["properties"]["leaderWorkerTemplate"]["properties"]
    template["leaderTemplate"] = template["workerTemplate"]  # deduplicated when vendored
    return data | {"openAPIV3Schema": schema}


def lws_manifest(path: Path = LWS_MANIFEST) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    (lws,) = [d for d in docs if d.get("kind") == "LeaderWorkerSet"]
    return lws


def check_lws(obj: dict) -> list[str]:
    data = lws_schema()
    errors = schema_errors(obj, data["openAPIV3Schema"])
    if obj.get("apiVersion") != f"{data['group']}/{data['version']}":
        errors.append(f"apiVersion {obj.get('apiVersion')!r} is not {data['group']}/{data['version']}")
    return errors


@MANIFESTS
def test_the_manifest_is_a_valid_leaderworkerset(manifest):
    assert check_lws(lws_manifest(manifest)) == []


def test_the_validator_catches_a_misspelt_field_a_bad_enum_and_a_wrong_type():
    """Negative control: the schema check is not vacuous."""
    bad = lws_manifest()
    bad["spec"]["leaderWorkerTemplate"]["restartpolicy"] = "RecreateGroupOnPodRestart"
    bad["spec"]["startupPolicy"] = "WhenReady"
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    errors = "\n".join(check_lws(bad))
    assert "unknown field 'restartpolicy'" in errors
    assert "'WhenReady' not one of" in errors
    assert "containerPort: expected integer" in errors


# -- the `supervise serve` line of each pod ---------------------------------------------------------------


def template_of(lws: dict, worker_index: int) -> dict:
    lwt = lws["spec"]["leaderWorkerTemplate"]
    return lwt.get("leaderTemplate", lwt["workerTemplate"]) if worker_index == 0 else lwt["workerTemplate"]


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command/args (an unknown reference stays as written; $$ is a $)."""
    return _K8S_VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def supervise_spec(argv: list[str]) -> LaunchSpec:
    assert argv[:2] == ["supervise", "serve"], argv
    return spec_from_args(build_parser().parse_args(["serve", *argv[2:]]))


def leader_address(lws: dict) -> str:
    """What LWS puts in LWS_LEADER_ADDRESS for group 0 of the set (in the default namespace)."""
    name = lws["metadata"]["name"]
    return f"{name}-0.{name}.default"


def pods(manifest: Path = LWS_MANIFEST) -> list[tuple[int, dict, LaunchSpec, dict]]:
    """(worker index, container, parsed spec, pod spec) for every pod of group 0."""
    lws = lws_manifest(manifest)
    size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
    out = []
    for index in range(size):
        pod = template_of(lws, index)["spec"]
        (container,) = [c for c in pod["containers"] if c["command"][:2] == ["supervise", "serve"]]
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        env |= {"LWS_LEADER_ADDRESS": leader_address(lws), "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
        argv = [k8s_expand(a, env) for a in [*container["command"], *container.get("args", [])]]
        out.append((index, container, supervise_spec(argv), pod))
    return out


@MANIFESTS
def test_every_pod_runs_one_node_of_one_group_with_the_leader_as_node_0(manifest):
    specs = pods(manifest)
    assert len(specs) >= 2
    for index, _container, spec, _pod in specs:
        assert spec.nnodes == len(specs) and spec.node_rank == index
        assert spec.master_addr == leader_address(lws_manifest(manifest))
        assert spec.command and spec.nproc_per_node >= 1
    # what the handshake compares is the same on every pod: the command, or an engine launcher's job
    jobs = {json.dumps(job_fields(s.command) if s.tree else list(s.command), sort_keys=True) for _, _, s, _ in specs}
    assert len(jobs) == 1, jobs
    assert len({(s.master_port, s.resolved_store_port, s.nproc_per_node, s.max_restarts) for _, _, s, _ in specs}) == 1


def test_the_vllm_leader_serves_through_the_relay_and_the_workers_are_headless():
    (_, _, leader, _), *workers = pods(LWS_VLLM)
    assert leader.relay.address is not None and leader.relay.upstream == "http://127.0.0.1:8001"
    assert "--headless" not in leader.command and all("--headless" in s.command for _, _, s, _ in workers)
    assert leader.engine_rendezvous == (leader.master_addr, 29500) and leader.resolved_store_port == 29501


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def probe_port(container: dict, probe: dict) -> int:
    port = probe["httpGet"]["port"]
    return named_ports(container)[port] if isinstance(port, str) else port


@MANIFESTS
def test_the_store_and_rendezvous_ports_are_exposed(manifest):
    for index, container, spec, _pod in pods(manifest):
        if index and spec.tree:  # an engine's rendezvous and the store are the leader's alone
            continue
        ports = {p["containerPort"] for p in container["ports"]}
        assert spec.master_port in ports and spec.resolved_store_port in ports
        assert spec.resolved_store_port != spec.master_port


@MANIFESTS
def test_probes_hit_what_the_command_line_serves(manifest):
    for _index, container, spec, _pod in pods(manifest):
        assert spec.metrics.addr is not None, "probes need --metrics-addr"
        host, port = spec.metrics.addr
        assert host not in ("127.0.0.1", "localhost", "::1"), "kubelet cannot reach a loopback bind"
        for name, path in PROBE_PATHS.items():
            probe = container[name]
            assert probe["httpGet"]["path"] == path, name
            assert probe_port(container, probe) == port, name


@pytest.mark.parametrize("state,live,ready", [(EngineState.READY, 200, 200), (EngineState.HUNG, 200, 503)])
def test_the_probe_paths_answer_as_docs_say_on_a_real_server(state, live, ready):
    """The manifest's probe paths on the real HealthServer: liveness stays 200 through a fault, readiness not."""
    (_i, container, _spec, _pod), *_ = pods()
    codes = {}
    with HealthServer(SupervisorMetrics("deploy", [0]), HealthCell(HealthStatus.for_state(state)), "127.0.0.1",
                      0) as server:
        for name in PROBE_PATHS:
            try:
                with urllib.request.urlopen(server.url + container[name]["httpGet"]["path"], timeout=5) as reply:
                    codes[name] = reply.status
            except urllib.error.HTTPError as exc:
                codes[name] = exc.code
    assert codes == {"startupProbe": ready, "readinessProbe": ready, "livenessProbe": live}


@MANIFESTS
def test_the_grace_period_covers_dump_teardown_linger_and_the_store(manifest):
    for index, _container, spec, pod in pods(manifest):
        linger = spec.metrics.linger if spec.metrics.linger is not None else DEFAULT_FAULT_LINGER_S
        store = link.STORE_LINGER_S if index == 0 else 0.0
        needed = spec.dumps.timeout + spec.kill_grace + linger + store
        assert pod["terminationGracePeriodSeconds"] >= needed, (index, needed)


@MANIFESTS
def test_the_startup_probe_waits_out_the_rendezvous_and_the_startup(manifest):
    for _index, container, spec, _pod in pods(manifest):
        probe = container["startupProbe"]
        budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3) + probe.get("initialDelaySeconds", 0)
        assert budget >= spec.nodes.rendezvous_timeout + spec.watchdog.startup_timeout


@MANIFESTS
def test_stacks_are_allowed_and_the_group_is_one_fate(manifest):
    lws = lws_manifest(manifest)
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"  # LeaderReady would deadlock
    assert lws["spec"]["leaderWorkerTemplate"].get("restartPolicy", "RecreateGroupOnPodRestart") in (
        "RecreateGroupOnPodRestart", "RecreateGroupAfterStart")
    for _index, container, _spec, _pod in pods(manifest):
        assert "SYS_PTRACE" in container["securityContext"]["capabilities"]["add"]
        assert "--join-token" not in " ".join(container["command"])  # the secret comes from the environment


# -- the plain two-host example -------------------------------------------------------------------------------


def run_two_hosts(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """Run the script for real with a stand-in `supervise` first on PATH that records its argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    shim = bindir / "supervise"
    shim.write_text('#!/bin/sh\nprintf \'%s\\0\' supervise "$@" > "$ARGV_OUT"\n')
    shim.chmod(0o755)
    out = tmp_path / "argv"
    out.unlink(missing_ok=True)
    base = {"PATH": f"{bindir}:{os.environ['PATH']}", "ARGV_OUT": str(out), "HOME": str(tmp_path)}
    res = subprocess.run(["bash", str(TWO_HOSTS)], env=base | env, capture_output=True, text=True,
                         timeout=SCRIPT_TIMEOUT_S)
    argv = out.read_text().split("\0")[:-1] if out.exists() else None
    return res, argv


def test_the_two_host_script_starts_both_nodes_of_one_group(tmp_path):
    specs = []
    for node_rank in (0, 1):
        res, argv = run_two_hosts(tmp_path, {"NODE_RANK": str(node_rank), "MASTER_ADDR": "10.0.0.1"})
        assert res.returncode == 0, res.stderr
        spec = supervise_spec(argv)
        assert (spec.nnodes, spec.node_rank, spec.master_addr) == (2, node_rank, "10.0.0.1")
        assert spec.resolved_store_port != spec.master_port and "MODEL_REVISION" in spec.nodes.fingerprint_env
        specs.append(spec)
    assert specs[0].command == specs[1].command and specs[0].nproc_per_node == specs[1].nproc_per_node


def test_the_two_host_script_refuses_to_guess_the_node_rank(tmp_path):
    res, argv = run_two_hosts(tmp_path, {"MASTER_ADDR": "10.0.0.1"})
    assert res.returncode != 0 and argv is None and "NODE_RANK" in res.stderr
