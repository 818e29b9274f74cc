"""Tree mode: which engine a launcher command runs, and where its own /metrics is (docs/supervisor.md)."""

from __future__ import annotations

import pytest

from tp_supervise.supervisor.spec import engine_metrics_source, launcher_engine, launcher_metrics_url

PY = "/opt/venv/bin/python"


@pytest.mark.parametrize(
    "command, engine, url",
    [
        ([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "8123"], "vllm", "http://127.0.0.1:8123/metrics"),
        (["vllm", "serve", "m", "--tensor-parallel-size", "8"], "vllm", "http://127.0.0.1:8000/metrics"),
        (["/usr/local/bin/vllm", "serve", "m", "--host", "10.1.2.3", "--port=9000"], "vllm", "http://10.1.2.3:9000/metrics"),
        (["numactl", "-N0", PY, "-m", "vllm.entrypoints.openai.api_server", "--host", "::"], "vllm", "http://[::1]:8000/metrics"),
        ([PY, "-m", "sglang.launch_server", "--model-path", "m", "--tp", "8"], "sglang", "http://127.0.0.1:30000/metrics"),
        ([PY, "-m", "sglang.launch_server", "--host", "0.0.0.0", "--port", "31000"], "sglang", "http://127.0.0.1:31000/metrics"),
        (["torchrun", "--nproc-per-node", "2", "serve.py", "--port", "8000"], None, None),
        ([PY, "my_vllm_wrapper.py", "--port", "8000"], None, None),
    ],
)
def test_launcher_recognised_and_metrics_url_derived(command, engine, url):
    assert launcher_engine(command) == engine
    assert launcher_metrics_url(command) == url


def test_engine_metrics_source_precedence():
    vllm = [PY, "-m", "vllm.entrypoints.openai.api_server", "--port", "8123"]
    assert engine_metrics_source(None, vllm, tree=True) == ("http://127.0.0.1:8123/metrics", "vllm")
    assert engine_metrics_source("none", vllm, tree=True) == (None, "auto")
    assert engine_metrics_source("http://h:1/metrics", vllm, tree=True) == ("http://h:1/metrics", "auto")
    assert engine_metrics_source(None, vllm, tree=False) == (None, "auto")  # spawn mode: the ranks are the command
    assert engine_metrics_source(None, [PY, "x.py"], tree=True) == (None, "auto")
