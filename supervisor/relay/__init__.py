"""The relay: the public port of a supervised engine, in a process that outlives every attempt of the group.

``supervise serve`` starts it beside the ranks, not as one::

    supervisor ─┬─ relay      the public address (inherited: SUPERVISE_LISTEN_FDS), run-long
                └─ group      built-in engine: rank 0 serves on a loopback socket the supervisor bound once;
                              a COMMAND (``--relay``): the engine's own listener (vLLM/SGLang --host/--port)

A restart of the group closes the engine's connections; without the relay
every request in flight, and every stream half sent, would end with an error
the client has to handle, and every new one would be refused until the next
attempt serves.  The relay holds the client's connection instead and
forwards each request upstream.  When the answer it gets is the group's
failure (the engine said so, a 5xx while the supervisor ruled a fault or the
engine's ``/health`` fails, a connection refused, reset or closed before the
answer was complete), it holds the request until the next attempt answers
``/health`` and sends it again; a stream continues from the tokens the
client already has; past its bounds, or when the run ends, a 503 naming the
incident.  docs/engine.md, "The relay".

One module per job:

==============  ==============================================================
``process``     the supervisor's side: starts the relay, starts it again if it
                dies, stops it at the end of the run, reads its counts
``main``        the relay process: its arguments, the inherited socket, the
                signals and stdin that end it, the counts it publishes
``http``        what a client's request meets: the handlers, resends, the 503s
``hold``        the group as the relay sees it: holding requests while it is
                down, probing for the next attempt, sending suspects alone
``resume``      one stream across attempts: relaying chunks, continuing it
``engines``     what differs per engine behind it (builtin, vllm, openai)
``protocol``    the one definition of each file and message the relay and the
                supervisor share
==============  ==============================================================

``process`` runs in the supervisor and may import ``processes/`` and
``rank/``; the relay process's modules import ``rank/`` and, of the engine,
only the stdlib-only definitions it shares with it (``engine.runfiles``:
the run dir's files; ``engine.openai_api``: the error vocabulary;
``engine.log``: the line format of the run's processes), never the decider.
"""
