"""``/v1/chat/completions`` with the official ``openai`` client against live engines (issue 21).

A chat request is the completion of its rendered prompt: through the
checkpoint's Jinja template (a checkpoint copy with ``tokenizer_config.json``
``chat_template``) and through the plain template (the random model), the
greedy chat output must be token-identical to ``/v1/completions`` of the
prompt the template renders, streamed or not.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.engine.conftest import post

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
TEMPLATE = ("{% if messages[0].role == 'assistant' %}{{ raise_exception('the conversation must start with a "
            "user or system message') }}{% endif %}{{ bos_token }} {% for m in messages %}"
            "{% if m.role == 'system' %}w3 {% endif %}{{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}w7{% endif %}")
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}


@pytest.fixture(scope="module")
def chat_ckpt(ckpt_a, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(ckpt_a, path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>",
                                                            "eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def engines(module_launcher, chat_ckpt):
    started = {"template": module_launcher("--model", str(chat_ckpt), "--max-context", "256", nproc=1, ready=False),
               "plain": module_launcher("--max-context", "256", nproc=1, ready=False)}
    for engine in started.values():
        engine.wait_ready()
    return started


def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_id(engine) -> str:
    return client(engine).models.list().data[0].id


def completion_ids(engine, prompt) -> dict:
    status, body = post(engine.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     "return_token_ids": True, "ignore_eos": True})
    assert status == 200, body
    return body


def streamed(engine, messages) -> tuple[str, list[int], list]:
    chunks = list(client(engine).chat.completions.create(model=model_id(engine), messages=messages, stream=True,
                                                         stream_options={"include_usage": True}, **GREEDY))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    return content, ids, chunks


def test_chat_through_the_checkpoint_template_is_the_completion_of_the_rendered_prompt(engines):
    engine = engines["template"]
    messages = [{"role": "developer", "content": "w10"}, {"role": "user", "content": [{"type": "text",
                                                                                      "text": "w5 w9"}]}]
    rendered = [1, 3, 10, 5, 9, 7]  # <s>, system marker w3, w10, w5 w9, generation prompt w7
    expected = completion_ids(engine, rendered)
    resp = client(engine).chat.completions.create(model=model_id(engine), messages=messages, **GREEDY)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == expected["choices"][0]["token_ids"]
    assert choice.message.content == expected["choices"][0]["text"]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(rendered), MAX_TOKENS)

    content, ids, chunks = streamed(engine, messages)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert content == choice.message.content and ids == choice.model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_through_the_plain_template(engines):
    engine = engines["plain"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = completion_ids(engine, "system: be brief\nuser: hello\nassistant: ")
    resp = client(engine).chat.completions.create(model=model_id(engine), messages=messages, **GREEDY)
    assert resp.choices[0].model_extra["token_ids"] == expected["choices"][0]["token_ids"]
    assert resp.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    content, ids, _ = streamed(engine, messages)
    assert ids == expected["choices"][0]["token_ids"] and content == resp.choices[0].message.content


def test_the_official_client_sees_4xx_for_bad_chat_requests(engines):
    engine = engines["template"]
    c, model = client(engine), model_id(engine)
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        c.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError, match="must start with a user or system message"):
        c.chat.completions.create(model=model, messages=[{"role": "assistant", "content": "w5"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model=model, messages=[{"role": "tool", "content": "w5", "tool_call_id": "1"}])
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "w5"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5"}], max_tokens=300)


@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    ({"model": "x"}, 404),
    ({"messages": None}, 400),
    ({"messages": {"role": "user", "content": "w5"}}, 400),
    ({"messages": [{"role": "user", "content": ["w5"]}]}, 400),
    ({"messages": [{"role": "user", "content": "w5"}], "stream": "yes"}, 400),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 1.5}, 400),
    ({"messages": [{"role": "user", "content": "w5"}], "stop": [1]}, 400),
])
def test_malformed_chat_bodies_get_openai_errors(engines, body, status):
    code, resp = post(engines["template"].url, body, path="/v1/chat/completions")
    assert code == status, resp
    assert resp["error"]["message"] and resp["error"]["type"]
