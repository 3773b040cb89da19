"""No request, client or signal takes the server down (issue 23): bad sampling values are
400s, bodies are bounded (413) and timed (408), half-sent headers are dropped, the API key
and the host allow-list guard /v1, every route answers in OpenAI's error format, a request
that fails alone is a 500 for its client only, a failed engine makes the process exit 1,
and signals bound shutdown.  Every server runs on 127.0.0.1 and every wait is bounded."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cbatch.core.detokenizer import IncrementalDetokenizer
from cbatch.entrypoints.cli.main import main as cli_main
from tests.serving_utils import free_port, running_server, wait_healthy

openai = pytest.importorskip("openai")

KW = dict(max_num_seqs=8, seed=0)


@pytest.fixture(scope="module")
def server():
    with running_server("random:tiny", "tiny", **KW) as (url, engine):
        yield url, engine


def _assert_openai_error(r: httpx.Response, status: int, match: str = "") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and match in error["message"]
    return error


# ------------------------------------------------------------------ findings 1 and 2


@pytest.mark.parametrize("body, match", [
    ({"temperature": 1, "top_k": 9223372036854775808}, "top_k"),
    ({"top_k": 2**31 + 1}, "top_k"),
    ({"temperature": float("inf")}, "temperature"),  # JSON Infinity
    ({"temperature": float("nan")}, "temperature"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"logprobs": 10**6}, "logprobs"),
])
def test_values_the_step_cannot_run_are_400s_and_the_engine_lives(server, body, match):
    url, engine = server
    # json.dumps writes inf and nan as JavaScript's Infinity and NaN, which the server reads
    r = httpx.post(f"{url}/v1/completions", timeout=30,
                   content=json.dumps({"prompt": "hi", "max_tokens": 2, **body}),
                   headers={"content-type": "application/json"})
    _assert_openai_error(r, 400, match)
    assert httpx.get(f"{url}/health").status_code == 200 and engine.is_running
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


# ------------------------------------------------------------------ finding 3


def test_bodies_over_the_limit_are_413_before_parsing():
    with running_server(app_kwargs=dict(max_request_bytes=2048), **KW) as (url, _):
        big = {"prompt": list(range(1, 500)) * 2, "max_tokens": 2}
        _assert_openai_error(httpx.post(f"{url}/v1/completions", json=big), 413, "2048")

        def chunks():  # no content-length: counted as it arrives
            data = json.dumps(big).encode()
            for i in range(0, len(data), 512):
                yield data[i:i + 512]

        r = httpx.post(f"{url}/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})
        _assert_openai_error(r, 413)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200


def test_a_long_token_list_is_refused_by_length():
    with running_server(**KW) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 5000, "max_tokens": 2})
        _assert_openai_error(r, 400, "maximum length")


# ------------------------------------------------------------------ finding 5


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(data)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_half_sent_headers_and_bodies_are_dropped():
    with running_server(app_kwargs=dict(body_timeout=0.5),
                        server_kwargs=dict(header_timeout=0.5),
                        **KW) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        start = time.monotonic()
        headers = [_raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                   for _ in range(20)]
        body = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pr")
        reply = _read_until_closed(body)
        assert reply.startswith(b"HTTP/1.1 408") and b'"error"' in reply
        assert all(_read_until_closed(s) == b"" for s in headers)  # closed by the server
        assert time.monotonic() - start < 15
        for s in headers + [body]:
            s.close()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200  # nobody is locked out


# ------------------------------------------------------------------ finding 8


@pytest.mark.slow
def test_chat_template_errors_and_unknown_roles_are_400s(tiny_hf_dir, tmp_path):
    import shutil

    path = tmp_path / "strict-chat"
    shutil.copytree(tiny_hf_dir, path)
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversation roles must start with user') }}{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with running_server(str(path), "chat", **KW) as (url, engine):
        def chat(messages):
            return httpx.post(f"{url}/v1/chat/completions",
                              json={"messages": messages, "max_tokens": 2}, timeout=30)

        _assert_openai_error(chat([{"role": "assistant", "content": "hi"}]), 400,
                             "roles must start with user")
        error = _assert_openai_error(chat([{"role": "wizard", "content": "hi"}]), 400)
        assert "role" in error["message"]
        assert chat([{"role": "user", "content": "hi"}]).status_code == 200
        assert engine.is_running


# ------------------------------------------------------------------ finding 10


def test_api_key_guards_v1_routes_only():
    with running_server(app_kwargs=dict(api_key="sekret"), **KW) as (url, _):
        error = _assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
        assert error["code"] == "invalid_api_key"
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"})
        _assert_openai_error(r, 401)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        _assert_openai_error(r, 401)
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.slow
def test_a_loopback_server_answers_loopback_host_names_only():
    from cbatch.entrypoints.openai.hosts import default_allowed_hosts

    assert default_allowed_hosts("0.0.0.0") is None
    allowed = default_allowed_hosts("127.0.0.1")
    assert {"localhost", "127.0.0.1", "::1"} <= set(allowed)
    with running_server(app_kwargs=dict(allowed_hosts=allowed), **KW) as (url, _):
        port = url.rsplit(":", 1)[1]
        for host in ("rebind.example", f"rebind.example:{port}", "127.0.0.2.nip.io"):
            r = httpx.get(f"{url}/v1/models", headers={"Host": host})
            _assert_openai_error(r, 400, "not an allowed host")
        r = httpx.get(f"{url}/health", headers={"Origin": "http://rebind.example"})
        _assert_openai_error(r, 400, "not an allowed host")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
            assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200
        r = httpx.get(f"{url}/v1/models", headers={"Origin": f"http://localhost:{port}"})
        assert r.status_code == 200


# ------------------------------------------------------------------ finding 11


def test_every_route_answers_in_openai_error_format(server):
    url, _ = server
    _assert_openai_error(httpx.get(f"{url}/v1/nope"), 404)
    _assert_openai_error(httpx.get(f"{url}/v1/completions"), 405)
    for content, ctype in ((b"{not json", "application/json"), (b"{not json", None),
                           (b"[1, 2]", "application/json"), (b"", "application/json")):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(f"{url}/v1/completions", content=content, headers=headers)
        assert r.status_code in (400, 422) and set(r.json()) == {"error"}, r.text


def test_a_request_that_fails_alone_is_a_500_for_its_client_only(server, monkeypatch):
    url, _ = server
    advance = IncrementalDetokenizer._advance

    def faulty(self, num_tokens):
        if self.token_ids[:3] == [9, 9, 9] and num_tokens > self.num_prompt_tokens + 1:
            raise RuntimeError("injected detokenizer fault: secret internals")
        return advance(self, num_tokens)

    monkeypatch.setattr(IncrementalDetokenizer, "_advance", faulty)
    body = {"prompt": [9, 9, 9], "max_tokens": 20, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    error = _assert_openai_error(r, 500)
    assert "secret" not in r.text and error["type"] == "server_error"
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert "secret" not in "".join(events)
    ok = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [8, 9, 9]}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------ findings 9 and 12


@pytest.mark.parametrize("argv, match", [
    (["--port", "-1"], "--port"),
    (["--port", "99999"], "--port"),
    (["--threads", "0"], "--threads"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["--max-request-bytes", "0"], "--max-request-bytes"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--attention-backend", "bogus"], "backend"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    # settings that would refuse everyone (issue 41, finding 9), or never free a slot
    (["--allowed-hosts", ","], "names no host"),
    (["--allowed-hosts", " , "], "names no host"),
    (["--allowed-hosts", "example.com,a/b"], "'a/b' is not a host name"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--queue-timeout", "0"], "--queue-timeout"),
    (["--write-timeout", "nan"], "--write-timeout"),
])
def test_bad_serve_flags_are_one_line_errors_before_serving(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--model", "random:tiny", "--device", "cpu",
                  "--port", str(free_port()), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("cbatch: error:") and match in err


# ------------------------------------------------------------------ findings 1, 4, 11: processes

SERVE = [sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve", "--model", "random:tiny",
         "--threads", "1", "--device", "cpu"]

FAULTY_STEP = """
import sys
from cbatch.core import model_runner
execute = model_runner.ModelRunner.execute
def faulty(self, batch, scheduled):
    if any(item.seq.prompt_token_ids == [7, 7, 7] for item in scheduled):
        raise RuntimeError("injected step failure: secret internals")
    return execute(self, batch, scheduled)
model_runner.ModelRunner.execute = faulty
from cbatch.entrypoints.cli.main import main
main(sys.argv[1:])
"""

# A server whose every step takes at least 20 ms, so that LONG requests (250 steps each) outlast
# the shutdown tests' timeouts on a machine of any speed.
SLOW_STEPS = """
import sys, time
from cbatch.core import model_runner
execute = model_runner.ModelRunner.execute
def slow(self, batch, scheduled):
    time.sleep(0.02)
    return execute(self, batch, scheduled)
model_runner.ModelRunner.execute = slow
from cbatch.entrypoints.cli.main import main
main(sys.argv[1:])
"""
SLOW_SERVE = [sys.executable, "-c", SLOW_STEPS, *SERVE[3:]]


def _start(args: list[str], argv0: list[str] = SERVE) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*argv0, "--port", str(port), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
    except TimeoutError:
        proc.kill()
        raise AssertionError(proc.communicate(timeout=30)[0].decode()[-3000:]) from None
    return proc, url


def _post_in_background(url: str, bodies: list[dict]) -> list:
    results: list = []

    def post(body):
        try:
            results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
        except httpx.HTTPError as e:
            results.append(e)

    for body in bodies:
        threading.Thread(target=post, args=(body,), daemon=True).start()
    return results


LONG = {"prompt": [1, 2], "max_tokens": 250, "ignore_eos": True}


def _stream_in_background(url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    """A thread streaming ``body`` from ``url`` (started), and the list its SSE data lines
    fill, ``[DONE]`` last."""
    events: list[str] = []

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    return reader, events


@pytest.mark.slow
def test_a_failed_engine_makes_the_process_exit_1_without_telling_clients_why():
    proc, url = _start(["--max-num-seqs", "2"], [sys.executable, "-c", FAULTY_STEP, "serve",
                                                  "--model", "random:tiny", "--threads", "1",
                                                  "--device", "cpu"])
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [7, 7, 7], "max_tokens": 3},
                       timeout=60)
        _assert_openai_error(r, 503)
        assert "secret" not in r.text
        code = proc.wait(timeout=30)  # a supervisor sees it go and restarts it
    finally:
        proc.kill()
    out = proc.communicate(timeout=30)[0].decode()
    assert code == 1, out[-3000:]
    assert "secret internals" in out  # the reason is in the log


@pytest.mark.slow
def test_sigterm_aborts_what_is_left_after_the_shutdown_timeout_and_exits():
    proc, url = _start(["--max-num-seqs", "1", "--shutdown-timeout", "1"], SLOW_SERVE)
    try:
        r = httpx.get(f"{url}/v1/models", headers={"Host": "rebind.example"})
        _assert_openai_error(r, 400)  # a loopback server refuses foreign host names
        _post_in_background(url, [LONG] * 8)  # queued work far longer than 1 s
        port = int(url.rsplit(":", 1)[1])
        half = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        reader, events = _stream_in_background(url, LONG)
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - start
        reader.join(timeout=10)
        half.close()
    finally:
        proc.kill()
    out = proc.communicate(timeout=30)[0].decode()
    assert took < 10, (took, out[-3000:])  # 1 s for the requests, 1 more for the sockets
    assert proc.returncode in (0, -signal.SIGTERM), out[-3000:]
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]
              if json.loads(e).get("choices")]
    assert events[-1] == "[DONE]" and finals[-1] == "abort", events[-3:]


@pytest.mark.slow
def test_a_second_signal_exits_at_once():
    proc, url = _start(["--max-num-seqs", "1", "--shutdown-timeout", "120"], SLOW_SERVE)
    try:
        _post_in_background(url, [LONG] * 8)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # still letting requests finish
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    out = proc.communicate(timeout=30)[0].decode()
    assert took < 5 and code == 128 + signal.SIGTERM, (took, code, out[-3000:])


@pytest.mark.slow
def test_cbatch_api_key_from_the_environment():
    port = free_port()
    proc = subprocess.Popen([*SERVE, "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ,
                                                           "CBATCH_API_KEY": "from-env"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
