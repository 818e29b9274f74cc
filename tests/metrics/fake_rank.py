"""A torch-free fake rank: claims its heartbeat slot and runs steps forever.

Each step holds a short "collective".  Started by the tests with the
SUPERVISE_* environment of a supervised rank; exits when the test process
(SUPERVISE_SUPERVISOR_PID) goes away.
"""

import time

from tp_supervise.supervisor.rank import runtime as sv

STEP_S = 0.01

sv.starting()
sv.ready()
print("ready", flush=True)
while True:
    with sv.step():
        with sv.collective("all_reduce", "16x16 float32"):
            time.sleep(STEP_S)
