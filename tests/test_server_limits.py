"""`specee serve` under pressure: API keys, a full queue, the time limit, clients that go away
and SIGTERM. The server ignores EOS, so every request runs to its max_tokens: a long request is
long for sure."""
import socket
import threading
import time

import httpx
import openai
import pytest

from serve_helpers import running_server

pytestmark = pytest.mark.slow  # a real server with the default model

KEY = "test-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIME_LIMIT_S = 10
BODY_TIMEOUT_S = KEEP_ALIVE_S = 3
GRACE_S = 8
# Dense: with --ignore-eos the story repeats itself, and `auto` copying it finishes 4000 tokens in
# under the time limit on a fast CPU (9.4 s on a Zen 5); these tests need a request that outlasts it.
DENSE = {"spec_method": "none"}
LONG = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4000, "specee": DENSE}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    # One slot, so a second request waits in the queue (batching has tests of its own).
    running = running_server("--ignore-eos", "--max-batch", "1", "--max-queue", "1", "--api-key", KEY,
                            "--request-timeout", str(TIME_LIMIT_S), "--body-timeout", str(BODY_TIMEOUT_S),
                            "--keep-alive-timeout", str(KEEP_ALIVE_S), "--shutdown-grace", str(GRACE_S))
    yield running
    running.stop()  # the SIGTERM test has usually stopped it already


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def engine_steps(server) -> float:
    line = next(l for l in httpx.get(server.url + "/metrics").text.splitlines()
                if l.startswith("specee_engine_steps_total"))
    return float(line.split()[-1])


def test_v1_routes_need_the_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.get(server.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    refused = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/slots").status_code == 401  # the running answers are the users' own
    assert httpx.get(server.url + "/slots", headers=AUTH).json()["slots"] == []
    assert httpx.get(server.url + "/health").status_code == 200  # probes and scrapers need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_that_disconnects_frees_the_engine(server):
    steps_before = engine_steps(server)
    with httpx.stream("POST", server.url + CHAT, json={**LONG, "stream": True}, headers=AUTH) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
    assert wait_for(lambda: health(server)["running"] == 0, timeout=20)
    settled = engine_steps(server)
    time.sleep(0.5)
    assert engine_steps(server) == settled  # the cancelled generation takes no more steps
    assert settled - steps_before < 200  # it stopped long before its 4000 tokens
    start = time.monotonic()
    quick = httpx.post(server.url + CHAT, json={**LONG, "max_tokens": 2}, headers=AUTH, timeout=30)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 2
    assert time.monotonic() - start < 20  # behind the cancelled request's 4000 tokens it would take minutes
    assert 'specee_generations_total{outcome="cancelled"} 1.0' in httpx.get(server.url + "/metrics").text


def test_a_non_streaming_client_that_gives_up_cancels_its_request(server):
    with pytest.raises(httpx.ReadTimeout):  # the client waits one second, then closes the connection
        httpx.post(server.url + CHAT, json=LONG, headers=AUTH, timeout=1)
    assert wait_for(lambda: health(server)["running"] == 0, timeout=20)
    assert 'specee_generations_total{outcome="cancelled"} 2.0' in httpx.get(server.url + "/metrics").text


def test_a_full_queue_answers_503_and_the_time_limit_ends_a_queued_request(server):
    results = {}

    def post(name):
        results[name] = httpx.post(server.url + CHAT, json=LONG, headers=AUTH, timeout=60)

    running = threading.Thread(target=post, args=("running",))
    running.start()
    assert wait_for(lambda: health(server)["running"] == 1)
    queued = threading.Thread(target=post, args=("queued",))
    queued.start()
    assert wait_for(lambda: health(server)["queued"] == 1)
    refused = httpx.post(server.url + CHAT, json=LONG, headers=AUTH)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    running.join()
    queued.join()
    for name in ("running", "queued"):  # 4000 tokens take longer than the limit
        assert results[name].status_code == 504, results[name].text
        assert results[name].json()["error"]["code"] == "request_timeout"


def test_a_stream_past_the_time_limit_ends_with_an_error_event(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    received = 0
    request = {key: value for key, value in LONG.items() if key != "specee"}
    with pytest.raises(openai.APIError, match="time limit"):
        for chunk in client.chat.completions.create(model=client.models.list().data[0].id, stream=True,
                                                    extra_body={"specee": DENSE}, **request):
            received += 1
    assert received >= 1  # it streamed, then the limit ended it


def raw_request(server, data: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port))
    connection.sendall(data)
    connection.settimeout(30)
    return connection


PARTIAL_BODY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 200\r\n\r\n{\"messa")


def test_a_client_that_hangs_up_mid_body_is_one_log_line(server):
    before = server.output()
    raw_request(server, PARTIAL_BODY).close()
    assert wait_for(lambda: "hung up before sending the whole request" in server.output()[len(before):])
    assert "Traceback" not in server.output()


def test_stalled_bodies_and_silent_connections_are_not_held(server):
    with raw_request(server, PARTIAL_BODY) as stalled:
        start = time.monotonic()
        answer = b""
        while b"body_timeout" not in answer and (part := stalled.recv(4096)):  # head and body may come apart
            answer += part
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
        assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - start < BODY_TIMEOUT_S + 5
    for sent in (b"", b"GET /health HTTP/1.1\r\nHo"):  # nothing at all, part of the headers
        with raw_request(server, sent) as silent:
            start = time.monotonic()
            assert silent.recv(4096) == b""  # closed by the server
            assert KEEP_ALIVE_S - 0.5 < time.monotonic() - start < KEEP_ALIVE_S + 5


def test_sigterm_finishes_or_ends_every_stream_and_exits_cleanly(server):
    """The running request finishes; the queued one, too long for the grace period, ends with an
    error event and [DONE] before the period is over; then the process exits 0."""
    streams = {"short": [], "long": []}

    def stream(name, max_tokens):
        with httpx.stream("POST", server.url + CHAT, json={**LONG, "max_tokens": max_tokens, "stream": True},
                          headers=AUTH, timeout=60) as response:
            streams[name].extend(line for line in response.iter_lines() if line)

    # About a second of decoding here, a few on a slow machine: long enough that the second
    # request is sure to arrive while it runs, even when speculation accepts most drafts on a
    # busy machine (96 tokens once did not), short enough to end well within the grace period.
    readers = [threading.Thread(target=stream, args=("short", 256))]
    readers[0].start()
    assert wait_for(lambda: health(server)["running"] == 1)
    readers.append(threading.Thread(target=stream, args=("long", 4000)))
    readers[1].start()
    assert wait_for(lambda: health(server)["queued"] == 1)
    start = time.monotonic()
    assert server.stop() == 0, server.output()
    assert time.monotonic() - start < GRACE_S + 5
    for reader in readers:
        reader.join()
    short, long = streams["short"], streams["long"]
    assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]
    assert long[-1] == "data: [DONE]" and '"code": "shutting_down"' in long[-2] and len(long) > 3
    assert "Traceback" not in server.output() and "Cancel" not in server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
