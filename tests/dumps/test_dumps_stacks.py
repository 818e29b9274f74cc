"""Parsers and normalised signatures (pure)."""

import json

import pytest

from tp_supervise.dumps import stacks as st

PYSPY = json.dumps(
    [
        {
            "pid": 100,
            "thread_id": 1401,
            "thread_name": "my-helper",
            "os_thread_id": 102,
            "active": False,
            "owns_gil": False,
            "frames": [
                {"name": "helper", "filename": "/x/t2.py", "module": None, "short_filename": "t2.py", "line": 2},
                {"name": "Thread.run", "filename": "/py/threading.py", "module": None, "line": 982},
                {"name": "Thread._bootstrap_inner", "filename": "/py/threading.py", "module": None, "line": 1045},
                {"name": "Thread._bootstrap", "filename": "/py/threading.py", "module": None, "line": 1002},
            ],
        },
        {
            "pid": 100,
            "thread_id": 1400,
            "thread_name": "MainThread",
            "os_thread_id": 100,
            "frames": [
                {"name": "clock_nanosleep", "filename": "libc.so.6", "module": "/lib/libc.so.6", "line": 0},
                {"name": "stuck_here", "filename": "/x/t2.py", "module": None, "line": 6},
                {"name": "<module>", "filename": "/x/t2.py", "module": None, "line": 7},
                {"name": "0x7f14ae44524a", "filename": "libc.so.6", "module": "/lib/libc.so.6", "line": 0},
            ],
        },
    ]
)

FAULTHANDLER = """Thread 0x00007f3cb443d6c0 (most recent call first):
  File "/y/t2.py", line 3 in helper
  File "/py/threading.py", line 982 in run
  File "/py/threading.py", line 1045 in _bootstrap_inner
  File "/py/threading.py", line 1002 in _bootstrap

Current thread 0x00007f3cb5082b80 (most recent call first):
  File "/y/t2.py", line 99 in stuck_here
  File "/y/t2.py", line 100 in <module>
"""


def test_pyspy_json_threads_frames_and_main():
    threads = st.parse_pyspy_json(PYSPY, pid=100)
    assert [t.name for t in threads] == ["my-helper", "MainThread"]
    main = st.main_thread(threads)
    assert main is not None and main.thread_id == "100"
    assert [f.function for f in main.python_frames] == ["stuck_here", "<module>"]
    assert main.frames[0].native and main.frames[0].function == "clock_nanosleep"


def test_faulthandler_threads_and_main_by_bootstrap_rule():
    threads = st.parse_faulthandler(FAULTHANDLER)
    assert len(threads) == 2
    main = st.main_thread(threads)
    assert main is not None and main.current
    assert main.frames[0] == st.Frame("stuck_here", "/y/t2.py", 99)
    assert not threads[0].is_main


def test_signature_same_place_same_signature_across_paths():
    """Line numbers, dirs, qualifiers, native frames and ids do not split a group."""
    a = st.stack_signature(st.parse_pyspy_json(PYSPY, pid=100))
    b = st.stack_signature(st.parse_faulthandler(FAULTHANDLER))
    assert a == b == "stuck_here (t2.py) < <module> (t2.py)"


def test_signature_differs_when_place_differs():
    other = FAULTHANDLER.replace("stuck_here", "load_batch")
    assert st.stack_signature(st.parse_faulthandler(other)) != st.stack_signature(st.parse_faulthandler(FAULTHANDLER))


def test_signature_without_known_main_uses_sorted_threads_and_skips_infra():
    t1 = st.ThreadStack("1", "", (st.Frame("b", "/a/x.py", 1),))
    t2 = st.ThreadStack("2", "", (st.Frame("a", "/a/x.py", 5),))
    infra = st.ThreadStack("3", "", (st.Frame("_watch_death", "/s/runtime.py", 1),))
    assert st.stack_signature([t1, t2, infra]) == st.stack_signature([infra, t2, t1]) == "a (x.py) | b (x.py)"


def test_empty_and_malformed():
    assert st.stack_signature([]) == ""
    assert st.parse_faulthandler("") == []
    with pytest.raises(ValueError):
        st.parse_pyspy_json("Error: Failed to find python version")
    with pytest.raises(ValueError):
        st.parse_pyspy_json('{"not": "a list"}')


def test_short_signature_and_innermost_skip():
    sig = "wait (threading.py) < wait (threading.py) < wait_in_all_reduce (r.py) < main (r.py)"
    assert st.short_signature(sig, 2) == "wait (threading.py) < wait (threading.py) < …"
    threads = [
        st.ThreadStack(
            "1",
            "",
            (st.Frame("Condition.wait", "/py/threading.py", 1), st.Frame("wait_in_all_reduce", "/r.py", 2)),
            is_main=True,
        )
    ]
    frame = st.innermost_function(threads, skip={"wait"})
    assert frame is not None and frame.function == "wait_in_all_reduce"


def test_render_puts_main_thread_first():
    text = st.render_threads(st.parse_pyspy_json(PYSPY, pid=100))
    assert text.index("main thread 100") < text.index("my-helper")
    assert "[native] clock_nanosleep" in text and "stuck_here (/x/t2.py:6)" in text


def test_where_skips_dispatch_and_wrapper_frames():
    """vLLM's all-reduce runs through torch's op dispatch and our wrapper: "where" is vLLM's function."""
    from tp_supervise.dumps.stacks import Frame, ThreadStack, innermost_function

    frames = (
        Frame("__call__", "/venv/torch/_ops.py", 1255),
        Frame("wrapper", "/x/tp_supervise/supervisor/rank/engines/__init__.py", 10),
        Frame("all_reduce", "/venv/vllm/distributed/parallel_state.py", 203),
        Frame("__call__", "/venv/torch/_ops.py", 1255),
        Frame("tensor_model_parallel_all_reduce", "/venv/vllm/distributed/communication_op.py", 14),
        Frame("forward", "/venv/vllm/model_executor/layers/linear.py", 1400),
        Frame("_call_impl", "/venv/torch/nn/modules/module.py", 1786),
    )
    thread = ThreadStack(thread_id="1", name="MainThread", frames=frames, is_main=True)
    where = innermost_function([thread])
    assert (where.base_function, where.base_file) == ("all_reduce", "parallel_state.py")


def test_where_names_the_compiled_model_not_a_hash():
    """vLLM's default mode runs its forward as code torch.compile generated (Inductor's module, a hash for a name):
    "where" says the compiled model, with the generated function and file beside it (issue 43)."""
    from tp_supervise.dumps.stacks import Frame, ThreadStack, innermost_function, where_text

    frames = (
        Frame("call", "/tmp/torchinductor_root/ct/ct64jzf52khgkqtpc3ljyriibgey4wo7cj37ixeyvatpgrtyifzh.py", 412),
        Frame("__call__", "/venv/vllm/compilation/cuda_graph.py", 120),
        Frame("forward", "/venv/vllm/model_executor/models/llama.py", 400),
        Frame("execute_model", "/venv/vllm/v1/worker/gpu_model_runner.py", 3000),
    )
    where = innermost_function([ThreadStack(thread_id="1", name="MainThread", frames=frames, is_main=True)])
    assert where_text(where) == (
        "the compiled model (torch.compile: call in ct64jzf52khgkqtpc3ljyriibgey4wo7cj37ixeyvatpgrtyifzh.py)"
    )
    plain = Frame("load_batch", "/srv/app/data.py", 3)
    assert where_text(plain) == "load_batch (data.py)"
    assert where_text(Frame("__compiled_fn_7", "<eval_with_key>.3", 5)).startswith("the compiled model")
    assert where_text(None) == ""


def test_where_in_a_compiled_model_names_the_function_it_compiles():
    """The main thread of a vLLM 0.32 worker SIGSTOPped in its compiled forward (py-spy's frames as a bundle of
    the engine tier holds them): the generated module is named with the model's function whose graph it runs,
    past torch's AOT and Dynamo wrappers."""
    from tp_supervise.dumps.stacks import Frame, ThreadStack, where

    site = "/venv/lib/python3.11/site-packages"
    frames = (
        Frame("OpOverload.__call__", f"{site}/torch/_ops.py", 875),
        Frame(
            "Runner.call",
            "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/7143/inductor_cache/t6/"
            "ct64jzf52khgkqtpc3ljyriibgey4wo7cj37ixeyvatpgrtyifzh.py",
            723,
        ),  # fmt: skip
        Frame("CompiledFxGraph.__call__", f"{site}/torch/_inductor/output_code.py", 763),
        Frame(
            "SerializableCompiledFunction.__call__", f"{site}/torch/_functorch/_aot_autograd/runtime_wrappers.py", 2548
        ),
        Frame("aot_module_simplified.<locals>.forward", f"{site}/torch/_functorch/aot_autograd.py", 1277),
        Frame("DisableContext.__call__.<locals>._fn", f"{site}/torch/_dynamo/eval_frame.py", 1446),
        Frame("BundledAOTAutogradSerializableCallable.__call__", f"{site}/torch/_dynamo/aot_compile_types.py", 221),
        Frame("LlamaModel.forward", f"{site}/vllm/model_executor/models/llama.py", 406),
        Frame("AOTCompiledFunction.__call__", f"{site}/torch/_dynamo/aot_compile.py", 244),
        Frame("GPUModelRunner.execute_model", f"{site}/vllm/v1/worker/gpu_model_runner.py", 4207),
    )
    threads = [ThreadStack(thread_id="1", name="MainThread", frames=frames, is_main=True)]
    assert where(threads) == (
        "the compiled model (torch.compile: call in ct64jzf52khgkqtpc3ljyriibgey4wo7cj37ixeyvatpgrtyifzh.py) "
        "of LlamaModel.forward (llama.py)"
    )
    eager = [ThreadStack(thread_id="1", name="MainThread", frames=frames[7:], is_main=True)]
    assert where(eager) == "forward (llama.py)"
