"""A test's fault plugin for real vLLM, put on PYTHONPATH by tests/engines/test_vllm.py (the supervisor's hook
runs first and chains this one, as it chains any sitecustomize of the program).  Nothing of the supervisor here.

TPS_TEST_FAULT=stuck: TP worker ``TPS_TEST_RANK`` (default 1) sleeps in Python inside ``execute_model`` once the
    file ``TPS_TEST_TRIGGER`` exists: stuck outside any collective while its peer waits in one.
TPS_TEST_FAULT=poison: TP worker ``TPS_TEST_RANK`` (default 1) dies (SIGKILL, as a segfault would end it) in the
    step that first schedules a request whose prompt token ids contain ``TPS_TEST_POISON_IDS`` (comma-separated, in
    that order): a request that kills the group every time it runs.
TPS_TEST_FAULT=sched_stuck: vLLM's engine core sleeps in Python inside ``Scheduler.schedule`` (in
    ``_plan_stuck``, a function of this file) once the file ``TPS_TEST_TRIGGER`` exists: the scheduler stuck in
    its scheduling call while the workers wait, idle, for its next step.
TPS_TEST_FAULT=rename: vLLM's ``GroupCoordinator._all_reduce_out_place`` is renamed, as a newer version might,
    before anything else sees the module (a version whose seams differ).

Both patch the module as it is imported, through a meta-path finder that asks every other finder for the spec,
the way many import hooks are written.
"""

import importlib.abc
import os
import sys
import time

FAULT = os.environ.get("TPS_TEST_FAULT", "")
TARGETS = {
    "stuck": "vllm.v1.worker.gpu_worker",
    "sched_stuck": "vllm.v1.core.sched.scheduler",
    "poison": "vllm.v1.worker.gpu_worker",
    "rename": "vllm.distributed.parallel_state",
}


def _stuck(module):
    rank = int(os.environ.get("TPS_TEST_RANK", "1"))
    trigger = os.environ["TPS_TEST_TRIGGER"]
    original = module.Worker.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.rank == rank and os.path.exists(trigger):
            while True:
                time.sleep(0.05)
        return original(self, scheduler_output, *args, **kwargs)

    module.Worker.execute_model = execute_model


def _plan_stuck(trigger):
    while os.path.exists(trigger):
        time.sleep(0.05)


def _sched_stuck(module):
    trigger = os.environ["TPS_TEST_TRIGGER"]
    original = module.Scheduler.schedule

    def schedule(self, *args, **kwargs):
        if os.path.exists(trigger):
            _plan_stuck(trigger)
        return original(self, *args, **kwargs)

    module.Scheduler.schedule = schedule


def _contains(ids, marker):
    n = len(marker)
    return any(list(ids[i : i + n]) == marker for i in range(len(ids) - n + 1))


def _poison(module):
    import signal

    rank = int(os.environ.get("TPS_TEST_RANK", "1"))
    marker = [int(i) for i in os.environ["TPS_TEST_POISON_IDS"].split(",")]
    original = module.Worker.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.rank == rank:
            for new in getattr(scheduler_output, "scheduled_new_reqs", None) or []:
                if _contains(new.prompt_token_ids or [], marker):
                    os.kill(os.getpid(), signal.SIGKILL)
        return original(self, scheduler_output, *args, **kwargs)

    module.Worker.execute_model = execute_model


def _rename(module):
    cls = module.GroupCoordinator
    cls._all_reduce_out_place_v2 = cls._all_reduce_out_place
    del cls._all_reduce_out_place
    cls.all_reduce = lambda self, input_: input_ if self.world_size == 1 else self._all_reduce_out_place_v2(input_)
    module.all_reduce = lambda tensor, group_name: module._groups[group_name]()._all_reduce_out_place_v2(tensor)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, change):
        self.inner, self.change = inner, change

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.change(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGETS.get(FAULT):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, {"stuck": _stuck, "sched_stuck": _sched_stuck, "poison": _poison, "rename": _rename}[FAULT])
                return spec
        return None


if FAULT in TARGETS:
    # After the supervisor's finder: its loader wraps ours, so our change is made before it checks the seams.
    sys.meta_path.insert(1 if sys.meta_path and "autohook" in type(sys.meta_path[0]).__module__ else 0, _Finder())
