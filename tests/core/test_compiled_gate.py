"""The hook is inert while torch.compile traces the engine (issue 43).

vLLM and SGLang compile their model with ``fullgraph=True`` by default, and a
collective of the model's forward goes through a wrapper of ours on its way
(vLLM's ``GroupCoordinator._all_reduce_out_place``; ``torch.distributed`` and
its functional collectives under it).  A real rank process, with the hook
installed from its ``sitecustomize`` as under ``supervise serve`` and a gloo
group of one, compiles a function that calls all three kinds with
``fullgraph=True`` (a graph break would raise), and the test compares the
graph with the same program's graph without the hook: the same nodes,
nothing of ours.  The slot's collective count does not move while compiling
nor while the compiled graph runs, and does move when the same function
runs eagerly (the wrappers are live: without the gate this program dies
with ``torch._dynamo.exc.Unsupported`` on the slot writer's lock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from tp_supervise.supervisor.processes.spawn import HOOK_DIR
from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank import runtime

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import json, mmap, os, socket, sys
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    hooked = "--hooked" in sys.argv
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    class Coordinator:  # vLLM's GroupCoordinator's shape: the method the engine adapter wraps
        def _all_reduce_out_place(self, input_):
            out = input_.clone()
            dist.all_reduce(out)
            return out

    if hooked:
        from tp_supervise.supervisor.rank import autohook, heartbeat as hb, runtime
        assert getattr(dist.all_reduce, "__tp_supervise_wrapped__", False), "the hook did not wrap torch.distributed"
        assert getattr(funcol.all_reduce, "__tp_supervise_wrapped__", False), "nor its functional collectives"
        plain = Coordinator._all_reduce_out_place
        Coordinator._all_reduce_out_place = autohook.collective_wrapper("vllm.all_reduce", plain)
        with open(os.environ[runtime.ENV_HEARTBEAT], "rb") as f:
            view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

        def collectives():
            base = hb.HEADER_SIZE
            return hb._decode(0, view[base : base + hb.SLOT_SIZE], torn=False).coll_seq
    else:
        def collectives():
            return 0

    coordinator = Coordinator()

    def model(x):
        y = coordinator._all_reduce_out_place(x * 2)
        z = funcol.all_reduce(y + 1, "sum", dist.group.WORLD)
        return funcol.wait_tensor(z) - 1

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([[n.op, str(n.target)] for n in gm.graph.nodes])
        return gm.forward

    x = torch.ones(4)
    before = collectives()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    results = [compiled(x) for _ in range(3)]
    after_compiled = collectives()
    eager = model(x)
    print(json.dumps({
        "graphs": graphs, "before": before, "after_compiled": after_compiled, "after_eager": collectives(),
        "same_result": all(torch.equal(r, eager) for r in results),
    }))
    """
)


def run(tmp_path: Path, hooked: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISE_")}
    env.pop("PYTHONPATH", None)
    segment = None
    if hooked:
        segment = hb.HeartbeatSegment(tmp_path / "hb", 1, uuid.uuid4().hex, time.monotonic())
        env.update({runtime.ENV_HEARTBEAT: str(segment.path), runtime.ENV_SLOT: "0", "RANK": "0"})
        env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), str(ROOT)])
    try:
        args = [sys.executable, "-c", PROGRAM] + (["--hooked"] if hooked else [])
        proc = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    finally:
        if segment is not None:
            segment.close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_wrapped_collective_compiles_fullgraph_to_the_engines_own_graph_with_no_side_effect(tmp_path):
    plain = run(tmp_path, hooked=False)
    hooked = run(tmp_path, hooked=True)

    assert len(hooked["graphs"]) == 1, "one graph: fullgraph, no break"
    assert hooked["graphs"] == plain["graphs"], "the traced graph holds the engine's calls and nothing of ours"
    assert any("all_reduce" in target for _op, target in hooked["graphs"][0]), "the collectives were traced"
    assert hooked["same_result"]
    assert hooked["after_compiled"] == hooked["before"], "compiling and running the graph counted nothing"
    assert hooked["after_eager"] > hooked["after_compiled"], "the same call in eager mode goes through the hook"
