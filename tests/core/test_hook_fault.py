"""A process that died of our own code is not blamed on the engine (issue 43).

The text is what vLLM 0.32's launcher wrote to its stderr when its compiled warm-up died on the hook's
wrapper before the hook had its torch.compile gate (tests/data/vllm-0.32-compiled-hook-fault.txt, from a real
run under ``supervise serve --tree``); the other cases are tracebacks that pass through our wrappers without
being ours.
"""

from __future__ import annotations

from pathlib import Path

from tp_supervise.supervisor.incidents import hook_fault

DATA = Path(__file__).resolve().parents[1] / "data"
RANK_DIR = "/work/main/supervisor/rank"  # where that run's supervisor had its rank package


def test_vllms_compiled_warm_up_dying_in_our_wrapper_names_the_hook_and_the_seam():
    text = (DATA / "vllm-0.32-compiled-hook-fault.txt").read_text()
    fault = hook_fault.find(text, RANK_DIR)
    assert fault is not None
    assert fault.raised_in.words() == "works.py:367 in wake"
    assert fault.wrapper.words() == "autohook.py:102 in wrapper"
    assert fault.entered_from is not None and fault.entered_from.words() == "parallel_state.py:745 in all_reduce"
    assert fault.exception.startswith("RuntimeError: Worker failed with error 'Unsupported context manager")
    assert "from user code:" in fault.traceback and "threading.py" in fault.traceback
    words = fault.words()
    assert "tp-supervise's own hook, not of the engine" in words and "all_reduce" in words
    assert fault.to_dict()["seam"] == "all_reduce"
    # another supervisor's rank package is not the one that raised
    assert hook_fault.find(text, "/opt/other/supervisor/rank") is None


ENGINE_FAULT = """\
(Worker_TP1 pid=12) Traceback (most recent call last):
(Worker_TP1 pid=12)   File "/venv/vllm/v1/executor/multiproc_executor.py", line 700, in worker_busy_loop
(Worker_TP1 pid=12)     output = func(*args, **kwargs)
(Worker_TP1 pid=12)   File "/srv/tp/supervisor/rank/engines/__init__.py", line 330, in wrapper
(Worker_TP1 pid=12)     result = fn(self, *args, **kwargs)
(Worker_TP1 pid=12)   File "/venv/vllm/v1/worker/gpu_worker.py", line 500, in execute_model
(Worker_TP1 pid=12)     raise ValueError("bad batch")
(Worker_TP1 pid=12) ValueError: bad batch
"""


def test_an_engine_exception_passing_through_our_wrapper_is_the_engines():
    assert hook_fault.find(ENGINE_FAULT, "/srv/tp/supervisor/rank") is None


def test_our_frame_innermost_past_the_standard_library_is_ours_with_prefixes_read_past():
    text = ENGINE_FAULT.replace("ValueError: bad batch", "RuntimeError: lock") + (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/venv/vllm/distributed/parallel_state.py", line 745, in all_reduce\n'
        "[rank1]:     return self._all_reduce_out_place(input_)\n"
        '[rank1]:   File "/srv/tp/supervisor/rank/autohook.py", line 96, in wrapper\n'
        "[rank1]:     ln = runtime.lane()\n"
        '[rank1]:   File "/srv/tp/supervisor/rank/slot_writer.py", line 366, in lane\n'
        "[rank1]:     with self._lock:\n"
        '[rank1]:   File "/usr/lib/python3.11/threading.py", line 597, in __enter__\n'
        "[rank1]: RuntimeError: cannot enter\n"
    )
    fault = hook_fault.find(text, "/srv/tp/supervisor/rank/")
    assert fault is not None
    assert (fault.raised_in.words(), fault.wrapper.words()) == ("slot_writer.py:366 in lane", "autohook.py:96 in wrapper")
    assert fault.entered_from.words() == "parallel_state.py:745 in all_reduce"
    assert fault.exception == "RuntimeError: cannot enter"


def test_a_drills_injected_fault_is_not_the_hooks():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/venv/vllm/v1/worker/gpu_worker.py", line 500, in execute_model\n'
        '  File "/srv/tp/supervisor/rank/drill_lane.py", line 170, in drilled\n'
        "RuntimeError: drill\n"
    )
    assert hook_fault.find(text, "/srv/tp/supervisor/rank") is None
