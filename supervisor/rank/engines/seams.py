"""What an engine module declares of its seams: ``Seam`` and the collectives of vLLM's ``GroupCoordinator``.

Stdlib only, like all of ``supervisor/rank/``: the engine modules (``vllm``,
``sglang``) are plain data built from these, imported by the rank-side hook
and by the supervisor alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import heartbeat as hb


@dataclass(frozen=True)
class Seam:
    """One method to wrap: ``owner.method`` in its module, as ``kind``.

    ``kind``: ``collective``, ``step`` or ``idle`` (a rank's slot); ``control_step``, ``control_idle``,
    ``control_schedule``, ``control_phase``, ``frontend``, ``frontend_output`` (the control slot of ``role``).  ``params``: the
    names its leading parameters must have (after ``self``); ``required``: a module whose required seam is
    missing is not wrapped at all (``optional`` ones are skipped alone: names that come and go between
    versions).  ``label``: the op (collectives) or phase (steps) shown.  ``releases``: the engine's releases
    (lowest, highest, inclusive) this seam was checked on, where it differs from the engine module's
    ``CHECKED_RELEASES``.
    """

    owner: str
    method: str
    kind: str
    params: tuple[str, ...] = ()
    required: bool = True
    label: str = ""
    role: int = hb.ROLE_RANK  # whose slot the seam writes: the rank's, or a control-plane role's
    releases: tuple[str, str] | None = None


def group_coordinator(engine: str) -> tuple[Seam, ...]:
    """vLLM's ``GroupCoordinator`` seams (``engine``: the label's prefix): the ``_*_out_place`` methods that
    both the eager call and the ``torch.ops.vllm.*`` custom op of a compiled graph run, the public others."""
    out = [
        Seam("GroupCoordinator", "_all_reduce_out_place", "collective", ("input_",), label=f"{engine}.all_reduce"),
        Seam(
            "GroupCoordinator", "_all_gather_out_place", "collective", ("input_", "dim"), label=f"{engine}.all_gather"
        ),
        Seam(
            "GroupCoordinator",
            "_reduce_scatter_out_place",
            "collective",
            ("input_", "dim"),
            label=f"{engine}.reduce_scatter",
        ),
        Seam("GroupCoordinator", "broadcast", "collective", ("input_", "src"), label=f"{engine}.broadcast"),
        Seam("GroupCoordinator", "barrier", "collective", (), label=f"{engine}.barrier"),
    ]
    for name in (
        "all_gatherv",
        "reduce_scatterv",
        "gather",
        "broadcast_object",
        "broadcast_object_list",
        "broadcast_tensor_dict",
        "send_object",
        "recv_object",
        "send_tensor_dict",
        "recv_tensor_dict",
        "send",
        "recv",
    ):
        out.append(Seam("GroupCoordinator", name, "collective", (), required=False, label=f"{engine}.{name}"))
    return tuple(out)
