"""`specee serve --replicas 2` of the default model on a two-node Ray cluster: answers
token-identical to one plain `specee serve`, and a replica killed mid-stream: its stream ends with
an error event, the other replica answers at once, and Ray's restarted replica takes traffic."""
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster_helpers import PROMPTS, Replicated, answers, client, counter, ray_cluster_fixture, wait_for

pytestmark = pytest.mark.slow
ray_cluster = pytest.fixture(scope="module")(ray_cluster_fixture)


@pytest.fixture(scope="module")
def default_replicated(ray_cluster):
    server = Replicated(ray_cluster)
    yield server
    assert server.stop() == 0, server.output()[-4000:]


def test_default_model_answers_match_one_plain_server(default_replicated, default_server):
    assert answers(default_replicated, 32) == answers(default_server, 32)


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_and_comes_back(default_replicated):
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
            "max_tokens": 400, "stream": True, "logit_bias": {"0": -100, "2": -100}}  # no end before the kill
    pids = {r["pid"] for r in default_replicated.replicas()}
    events = []
    with httpx.stream("POST", default_replicated.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:  # wait for the answer to be under way, then find and kill its replica
            if line.startswith("data: {"):
                break
        wait_for(lambda: any(r["running"] for r in default_replicated.replicas()), 30, "a running request",
                 default_replicated)
        victim = next(r for r in default_replicated.replicas() if r["running"])
        os.kill(victim["pid"], signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    # The other replica answers at once; Ray starts a new one, and traffic returns to it.
    assert client(default_replicated).completions.create(model=None, prompt="Hi", max_tokens=4).usage.completion_tokens == 4
    restarted = []

    def a_new_replica_reports() -> bool:
        live = default_replicated.replicas()
        restarted[:] = [r["replica"] for r in live if r["pid"] not in pids]
        return len(live) == 2 and len(restarted) == 1

    wait_for(a_new_replica_reports, 180, "a restarted replica", default_replicated)
    new = restarted[0]
    c = client(default_replicated)

    def the_new_replica_serves() -> bool:  # a round of concurrent requests; a warming replica may miss one
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: c.completions.create(model=None, prompt=PROMPTS[i], max_tokens=16), range(4)))
        deadline = time.monotonic() + 2.5  # replicas report their metrics every second
        while time.monotonic() < deadline:
            if counter(default_replicated, "specee_requests_total", replica=new, route="/v1/completions") > 0:
                return True
            time.sleep(0.25)
        return False

    wait_for(the_new_replica_serves, 120, "the restarted replica serving a request", default_replicated)
    assert counter(default_replicated, "specee_replica_failures_total") >= 1


def test_sigterm_lets_a_running_stream_finish_then_exits_0(default_replicated):
    body = {"messages": [{"role": "user", "content": "Count from one to twenty in words."}], "max_tokens": 64,
            "stream": True}
    with httpx.stream("POST", default_replicated.url + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        default_replicated.process.send_signal(signal.SIGTERM)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert "error" not in last and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert default_replicated.process.wait(120) == 0
