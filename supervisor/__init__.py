"""The parent process: ``supervise serve`` and its sibling commands.

At the top, the decider: ``core`` (the main loop; the one place that changes
state, starts dumps, kills and restarts), ``multinode`` (its multi-node
decisions), ``arbitration`` (what an exit means), ``restart`` (the policy),
``state``, ``outcome`` (exit codes), ``events`` (every event the loop
handles), ``signals``, ``spec`` and ``preflight`` (what to launch, checked
before anything starts), ``cli``, ``drills/`` (``supervise drill``) and ``logs``.  Below it, rooms:
``processes/`` (the mechanism of processes), ``observers/`` (threads that
watch and report), ``incidents/`` (bundles and their exchange across nodes),
``nodes/`` (the store, the handshake, the node link), and ``rank/`` (the
guest code inside every rank).  Arrows point down only: a room never imports
the decider modules (``core``, ``multinode``, ``arbitration``, ``restart``,
``cli``, ``drills``); it may import the vocabulary (``events``, ``outcome``,
``spec``, ``state``, ``signals``, ``logs``).  ``tests/test_layers.py``
checks it; docs/architecture.md is the map.
"""
