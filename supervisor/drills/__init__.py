"""``supervise drill``: break a run on purpose and score what the supervisor says (docs/drills.md).

``builtin`` drills the built-in engine through its ``--inject`` kinds; ``command`` is the fault campaign against
a COMMAND (the user's engine, behind the relay): ``kinds`` (what can break and what a perfect supervisor says,
pure), ``host`` (the cgroup limits and the broken environment a kind needs, undone after each trial).
"""
