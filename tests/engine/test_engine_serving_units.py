"""Torch-free parts of serving through faults: chat parsing and templates, fingerprints, the in-flight
file, the quarantine list, the incident id, socket activation, the poison injection (issue 21)."""

from __future__ import annotations

import json
import os
import socket
import struct

import pytest

from tp_supervise.engine.chat_api import JinjaTemplate, PlainTemplate, load_chat_template, parse_chat
from tp_supervise.engine.inject import ALL_KINDS, KINDS, POISON_MARKER, FaultInjector, InjectedFault, Injection
from tp_supervise.engine.openai_api import ApiError, quarantined
from tp_supervise.engine.runfiles import (
    HEADER,
    SLOT,
    SLOT_STEP_OFFSET,
    InflightFile,
    Quarantine,
    fingerprint,
    read_incident,
    read_inflight,
    write_quarantine,
)
from tp_supervise.engine.tokenizer import ByteTokenizer
from tp_supervise.supervisor.rank.listen import (
    SD_LISTEN_FDS_START,
    VARIABLES,
    ListenError,
    inherited_fd,
    take_listen_socket,
)

MODEL = "random-tiny"


def fp(ids=(256, 104, 105), **kw) -> str:
    args = dict(max_tokens=16, temperature=1.0, top_p=1.0, seed=None, stop=(), ignore_eos=False)
    args.update(kw)
    return fingerprint(MODEL, ids, **args)


# -- fingerprints ---------------------------------------------------------------------------------
def test_fingerprint_is_stable_and_covers_prompt_model_and_sampling():
    base = fp()
    assert len(base) == 32 and int(base, 16) >= 0
    assert fp() == base and fp(ids=[256, 104, 105]) == base
    variants = [fp(ids=(256, 104)), fp(max_tokens=17), fp(temperature=0.5), fp(top_p=0.9), fp(seed=0),
                fp(stop=("x",)), fp(ignore_eos=True), fingerprint("other", (256, 104, 105), 16, 1.0, 1.0, None, (),
                                                               False)]
    assert len({base, *variants}) == len(variants) + 1
    assert "hi" not in base  # a digest, never the text


# -- in-flight file -------------------------------------------------------------------------------
def test_inflight_file_records_adds_and_removes(tmp_path):
    path = tmp_path / "inflight-rank0"
    f = InflightFile(path, nslots=3, attempt=2)
    a, b, c, d = (fp(seed=i) for i in range(4))
    f.add("r1", a)
    f.add("r2", b)
    f.add("r3", c)
    f.add("r4", d)  # full: dropped, never raises
    snap = read_inflight(path)
    assert snap.fingerprints == (a, b, c) and snap.pid == os.getpid() and snap.attempt == 2 and snap.settled
    assert f.dropped == 1
    f.remove("r2")
    f.remove("unknown")
    f.add("r4", d)
    assert set(read_inflight(path).fingerprints) == {a, c, d}
    f.clear()
    assert read_inflight(path).fingerprints == ()
    assert read_inflight(path).generation % 2 == 0
    f.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inflight-rank0"]  # no temporary file left


def test_inflight_reader_after_a_death_mid_change_sees_only_complete_slots(tmp_path):
    """The writer died between writing a fingerprint and its state byte: that slot is not listed."""
    path = tmp_path / "inflight-rank0"
    f = InflightFile(path, nslots=2, attempt=0)
    f.add("r1", fp(seed=1))
    f.close()
    raw = bytearray(path.read_bytes())
    offset = HEADER.size + SLOT.size * 1
    struct.pack_into("<Q16s", raw, offset + 8, 123, bytes.fromhex(fp(seed=2)))  # state byte still 0
    struct.pack_into("<Q", raw, 24, struct.unpack_from("<Q", raw, 24)[0] + 1)  # generation odd: mid-change
    path.write_bytes(bytes(raw))
    snap = read_inflight(path)
    assert snap.fingerprints == (fp(seed=1),) and not snap.settled


def test_inflight_reader_refuses_other_files(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError):
        read_inflight(path)


# -- quarantine list, incident id -------------------------------------------------------------------
def test_quarantine_is_reread_when_the_file_changes(tmp_path):
    q = Quarantine(tmp_path)
    assert q.lookup(fp()) is None
    write_quarantine(tmp_path, {fp(): ["inc-1", "inc-2"]})
    assert q.lookup(fp()) == ("inc-1", "inc-2")
    assert q.lookup(fp(seed=1)) is None
    (tmp_path / "quarantine.json").write_text("{broken")  # a bad file keeps the previous list
    assert q.lookup(fp()) == ("inc-1", "inc-2")
    write_quarantine(tmp_path, {})
    assert q.lookup(fp()) is None
    (tmp_path / "quarantine.json").unlink()
    assert q.lookup(fp()) is None
    assert Quarantine(None).lookup(fp()) is None


def test_the_quarantine_refusal_names_its_incidents():
    body = quarantined(("inc-1", "inc-2")).body()["error"]
    assert body["code"] == "request_quarantined" and body["type"] == "invalid_request_error"
    assert "incidents inc-1, inc-2" in body["message"]
    assert "of an earlier attempt" in quarantined(()).body()["error"]["message"]


def test_suspects_are_read_and_the_reader_is_forward_compatible(tmp_path):
    q = Quarantine(tmp_path)
    write_quarantine(tmp_path, {fp(): ["inc-1", "inc-2"]}, suspects=[fp(seed=1), fp(seed=2)])
    assert q.lookup(fp(seed=1)) is None and q.suspected(fp(seed=1)) and q.suspected(fp(seed=2))
    assert not q.suspected(fp(seed=3)) and not q.suspected(fp())  # quarantined is not "suspected": it never runs
    # a file of the first layout (no "suspects"), and keys this engine does not know: still read
    (tmp_path / "quarantine.json").write_text(json.dumps({"version": 1, "fingerprints": {fp(seed=3): ["inc-3"]},
                                                          "later": {"x": 1}}))
    assert q.lookup(fp(seed=3)) == ("inc-3",) and not q.suspected(fp(seed=1))
    # suspects that are not a list of fingerprints are ignored, the quarantine still applies
    (tmp_path / "quarantine.json").write_text(json.dumps({"version": 1, "fingerprints": {fp(): ["inc-1"]},
                                                          "suspects": {"x": 1}}))
    assert q.lookup(fp()) == ("inc-1",) and not q.suspected(fp(seed=1))
    (tmp_path / "quarantine.json").unlink()
    write_quarantine(tmp_path, {}, suspects=[fp(seed=1)])
    assert q.lookup(fp(seed=1)) is None and q.suspected(fp(seed=1))
    (tmp_path / "quarantine.json").unlink()
    assert q.lookup(fp(seed=1)) is None and not q.suspected(fp(seed=1))


def test_inflight_slot_records_the_step_that_first_scheduled_it(tmp_path):
    path = tmp_path / "inflight-rank0"
    f = InflightFile(path, nslots=2, attempt=0)
    f.add("r1", fp(seed=1), step=7)
    f.add("r2", fp(seed=2))  # a writer that records no step: 0
    f.close()
    raw = path.read_bytes()
    steps = [struct.unpack_from("<I", raw, HEADER.size + SLOT.size * i + SLOT_STEP_OFFSET)[0] for i in range(2)]
    assert steps == [7, 0] and SLOT.size == 32
    assert read_inflight(path).fingerprints == (fp(seed=1), fp(seed=2))


def test_incident_id_is_the_first_printable_line(tmp_path):
    assert read_incident(None) is None and read_incident(tmp_path) is None
    (tmp_path / "incident").write_text("20260101T000000-rank_exit-1\nmore\n")
    assert read_incident(tmp_path) == "20260101T000000-rank_exit-1"
    (tmp_path / "incident").write_text("x" * 500)
    assert read_incident(tmp_path) is None
    (tmp_path / "incident").write_text("bad\x07id")
    assert read_incident(tmp_path) is None


# -- chat -------------------------------------------------------------------------------------------
def test_chat_messages_are_normalised():
    spec = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}], "name": "x"},
                                    {"role": "assistant", "content": None},
                                    {"role": "developer", "content": ""}],
                       "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0}, model_name=MODEL)
    assert spec.messages == (("system", "be brief"), ("user", "a\nb"), ("assistant", ""), ("developer", ""))
    assert spec.gen.max_tokens == 5 and spec.gen.temperature == 0.0
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9},
                      model_name=MODEL).gen.max_tokens == 9


@pytest.mark.parametrize("body,param", [
    ([], None),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_malformed_chat_bodies_are_400(body, param):
    with pytest.raises(ApiError) as exc:
        parse_chat(body, model_name=MODEL)
    assert exc.value.status == 400 and exc.value.param == param and exc.value.message


def test_chat_for_another_model_is_404():
    with pytest.raises(ApiError) as exc:
        parse_chat({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, model_name=MODEL)
    assert exc.value.status == 404


def test_plain_template():
    text = PlainTemplate().render((("system", "s"), ("user", "hi")))
    assert text == "system: s\nuser: hi\nassistant: "
    assert ByteTokenizer().encode(text, add_special_tokens=PlainTemplate.add_special_tokens)[0] == 256


def test_jinja_template_renders_refuses_and_falls_back(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.first and m.role == 'assistant' %}"
                "{{ raise_exception('the first message must not be from the assistant') }}{% endif %}"
                "[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                                                "eos_token": {"content": "</s>"}}))
    loaded = load_chat_template(str(tmp_path))
    assert isinstance(loaded, JinjaTemplate) and not loaded.add_special_tokens
    assert loaded.render((("developer", "d"), ("user", "u"))) == "<s>[system]d[user]u[assistant]"
    with pytest.raises(ApiError) as exc:
        loaded.render((("assistant", "a"),))
    assert exc.value.status == 400 and "must not be from the assistant" in exc.value.message
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content | tojson }}{% endfor %}")
    assert load_chat_template(str(tmp_path)).render((("user", "é"),)) == '"é"'  # the .jinja file wins
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")  # does not compile
    assert isinstance(load_chat_template(str(tmp_path)), PlainTemplate)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert isinstance(load_chat_template(str(tmp_path)), PlainTemplate)
    assert isinstance(load_chat_template(None), PlainTemplate)


def test_jinja_template_is_sandboxed(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}))
    with pytest.raises(ApiError) as exc:
        load_chat_template(str(tmp_path)).render((("user", "x"),))
    assert exc.value.status == 400


# -- socket activation ----------------------------------------------------------------------------
def test_listen_fds_follow_sd_listen_fds():
    assert inherited_fd({}, 100) is None
    assert inherited_fd({"LISTEN_PID": "100", "LISTEN_FDS": "2"}, 100) == (SD_LISTEN_FDS_START, 2, "LISTEN_FDS")
    assert inherited_fd({"LISTEN_PID": "101", "LISTEN_FDS": "1"}, 100) is None  # meant for another process
    assert inherited_fd({"LISTEN_PID": "100", "LISTEN_FDS": "0"}, 100) is None
    assert inherited_fd({"LISTEN_FDS": "1"}, 100) is None  # no LISTEN_PID: not ours (systemd's rule)
    assert inherited_fd({"SUPERVISE_LISTEN_FDS": "7"}, 100) == (7, 1, "SUPERVISE_LISTEN_FDS")
    assert inherited_fd({"LISTEN_PID": "101", "LISTEN_FDS": "1", "SUPERVISE_LISTEN_FDS": "9"}, 100)[0] == 9
    for env in ({"LISTEN_PID": "x", "LISTEN_FDS": "1"}, {"LISTEN_PID": "100", "LISTEN_FDS": "one"},
                {"SUPERVISE_LISTEN_FDS": "seven"}, {"SUPERVISE_LISTEN_FDS": "1"}):
        with pytest.raises(ListenError):
            inherited_fd(env, 100)


def test_take_listen_socket_checks_the_fd_and_clears_the_environment():
    listener = socket.create_server(("127.0.0.1", 0))
    child = os.dup(listener.fileno())
    os.set_inheritable(child, True)
    env = {"SUPERVISE_LISTEN_FDS": str(child), "LISTEN_FDNAMES": "http", "OTHER": "1"}
    sock = take_listen_socket(env, os.getpid(), use=True)
    assert env == {"OTHER": "1"}
    assert sock.fileno() == child and not sock.get_inheritable()
    assert sock.getsockname() == listener.getsockname()
    sock.close()
    env = {"SUPERVISE_LISTEN_FDS": str(child), "LISTEN_PID": "1", "LISTEN_FDS": "1"}
    assert take_listen_socket(env, os.getpid(), use=False) is None and env == {}  # other ranks: cleared only
    unbound = socket.socket()
    r, w = os.pipe()
    closed = os.dup(r)
    os.close(closed)
    try:
        for fd, needle in ((unbound.fileno(), "not listening"), (r, "not a socket"), (closed, "not open")):
            with pytest.raises(ListenError, match=needle):
                take_listen_socket({"SUPERVISE_LISTEN_FDS": str(fd)}, os.getpid(), use=True)
        os.fstat(unbound.fileno())  # a rejected fd is left open: it is not ours to close
    finally:
        unbound.close()
        listener.close()
        os.close(r)
        os.close(w)
    assert set(VARIABLES) == {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "SUPERVISE_LISTEN_FDS"}


# -- poison injection ------------------------------------------------------------------------------
def test_poison_is_a_request_kind_outside_the_drill_kinds():
    assert "poison" in ALL_KINDS and "poison" not in KINDS
    inj = Injection.parse("poison@1")
    assert (inj.kind, inj.rank, str(inj)) == ("poison", 1, "poison@1")
    assert Injection.parse(str(inj)) == inj
    with pytest.raises(ValueError, match="triggered by a request"):
        Injection.parse("poison@1:3")


def test_poison_fires_only_on_its_rank_for_a_marked_prompt():
    tok = ByteTokenizer()
    marked = tok.encode(f"please {POISON_MARKER} now")
    mine = FaultInjector((Injection("poison", 1),), rank=1, decode=tok.decode)
    other = FaultInjector((Injection("poison", 1),), rank=0, decode=tok.decode)
    assert mine.wants_prompts and not other.wants_prompts
    mine.check_prompts([tok.encode("harmless"), tok.encode("TPS_POIS")])
    other.check_prompts([marked])
    with pytest.raises(InjectedFault, match="poison on rank 1"):
        mine.check_prompts([tok.encode("harmless"), marked])
