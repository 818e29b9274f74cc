"""A supervised engine's HTTP side: waiting until it serves, the official client's requests, stopping it.

The requests go through the official ``openai`` client (the caller's, built by
``openai_client``) to the built-in engine's ``random-tiny`` model, with
``ignore_eos`` so that every complete answer has exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import signal
import subprocess
import time

import httpx2
import openai

from tp_supervise.supervisor.drills.builtin import wait_answering

MODEL = "random-tiny"
KINDS = ("completion", "completion_stream", "chat", "chat_stream")
KILL_WAIT_S = 30.0


def wait_serving(proc: subprocess.Popen, port: int, limit_s: float) -> bool:
    """Poll ``/health`` on ``port`` until it answers 200 (True), or ``proc`` exited or ``limit_s`` passed (False):
    the product's own wait (``supervise drill`` uses it)."""
    return wait_answering(port, "/health", proc, time.monotonic() + limit_s)


def stop_supervisor(proc: subprocess.Popen, limit_s: float) -> int:
    """SIGTERM (if it still runs), its exit code within ``limit_s``; past that, SIGKILL and its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(KILL_WAIT_S)


def openai_client(port: int, transport: httpx2.HTTPTransport, timeout_s: float) -> openai.OpenAI:
    """The official client against the engine on ``port``, every attempt through ``transport`` (default retries)."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        timeout=timeout_s,
        http_client=httpx2.Client(transport=transport),
    )


def request_ok(api: openai.OpenAI, kind: str, prompt: str, max_tokens: int) -> bool:
    """Send one request of ``kind`` (one of ``KINDS``): whether the whole answer came.

    Raises what the client raises (after its retries)."""
    if kind not in KINDS:
        raise ValueError(f"request kind {kind!r}: one of {KINDS}")
    chat = kind.startswith("chat")
    args = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if chat:
        args["messages"] = [{"role": "user", "content": prompt}]
    else:
        args["prompt"] = prompt
    create = api.chat.completions.create if chat else api.completions.create
    if kind.endswith("_stream"):
        finish = None
        for chunk in create(**args, stream=True):
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        return finish == "length"
    out = create(**args)
    if not out.choices or out.usage is None or out.usage.completion_tokens != max_tokens:
        return False
    return not chat or out.choices[0].message.role == "assistant"
