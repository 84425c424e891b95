"""`specee serve --replicas 2` on a two-node Ray cluster with a tiny random model: Ray's own `serve
run` of deploy/serve.yaml, a replica that cannot load, answers token-identical to one plain `specee
serve`, load reaching both replicas and prefix-aware routing. The default model and faults:
tests/test_cluster_faults.py."""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from cluster_helpers import (ENV, PROMPTS, ROOT, SYSTEM, Replicated, answers, client, counter, ray_cluster_fixture,
                             serve_port, wait_for)
from helpers import tiny_model_directory
from serve_helpers import running_server
from specee.eval.server_process import ChildServer

pytestmark = pytest.mark.slow
ray_cluster = pytest.fixture(scope="module")(ray_cluster_fixture)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    # A context long enough for prompts that share several of the router's blocks.
    return str(tiny_model_directory(tmp_path_factory.mktemp("tiny"), seed=3, max_position_embeddings=2048))


@pytest.fixture(scope="module")
def tiny_replicated(ray_cluster, tiny):
    server = Replicated(ray_cluster, "--model", tiny, api_key="cluster-key-5d1")
    yield server
    assert server.stop() == 0, server.output()[-4000:]


def test_the_serve_config_runs_with_rays_own_serve_run(ray_cluster, tiny, tmp_path):
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    port = ray_cluster.serve_port
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["applications"][0]["args"] |= {"model": tiny}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).with_name("serve")
    server = ChildServer([str(serve_cli), "run", str(path), "--address", ray_cluster.address], port, cwd=ROOT, env=ENV)
    try:
        wait_for(lambda: len(httpx.get(server.url + "/health", timeout=10).json()["replicas"]) == 2, 180,
                 "two replicas", server)
        answer = client(server).completions.create(model=None, prompt="hello", max_tokens=4)
        assert answer.usage.completion_tokens == 4
    finally:
        server.stop()
        subprocess.run([str(serve_cli), "shutdown", "--address", ray_cluster.address, "-y"], env=ENV, timeout=120,
                       capture_output=True)


def test_a_replica_that_cannot_load_fails_the_start_with_its_error(ray_cluster, tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((Path(tiny) / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).symlink_to(Path(tiny) / name)
    done = subprocess.run([sys.executable, "-m", "specee.cli", "serve", "--port", str(ray_cluster.serve_port), "--model",
                           str(broken), "--replicas", "2", "--threads", "1", "--address", ray_cluster.address],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("specee: error:")]
    assert len(said) == 1 and said[0].startswith("specee: error: the replicas did not start:"), done.stderr[-3000:]
    assert "config.json: the model config lacks required field(s) hidden_size" in said[0], said[0]





def test_the_cluster_benchmark_serves_dense_on_the_cluster(ray_cluster, tiny, tmp_path):
    """benchmarks/cluster_scaling.py's N-replica deployment on this module's cluster (a Ray start
    of its own takes tens of seconds): the cluster's /metrics, summed over its replicas, say every
    pass was dense."""
    from test_benchmark_runs import assert_dense, last_json

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_scaling.py"), "--model", tiny,
                           "--deployments", "ray-n", "--replicas", "2", "--address", ray_cluster.address,
                           "--port", str(ray_cluster.serve_port), "--concurrency", "1", "--max-tokens", "4",
                           "--out", str(tmp_path / "cluster")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = last_json(done.stdout)
    assert report["spec_method"] == "none"
    (name, decoded), = report["decoded_with"].items()
    assert name == "ray 2x1"
    assert_dense(decoded)
    (row,) = report["load"]
    assert row["deployment"] == name and row["system"] == "specee dense" and row["clients"] == 1
    assert row["completion_tokens"] > 0 and row["tokens_per_s"] > 0


def test_tiny_answers_match_one_plain_server(tiny_replicated, tiny):
    single = running_server("--model", tiny)
    try:
        expected = answers(single, 24)
    finally:
        assert single.stop() == 0
    got = answers(tiny_replicated, 24)
    assert got == expected
    assert all(text == streamed for text, _, _, streamed in got)


def test_the_key_the_live_page_and_the_slots_of_every_replica(tiny_replicated):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    refused = httpx.post(tiny_replicated.url + "/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(tiny_replicated.url + "/slots", timeout=10).status_code == 401
    key = {"Authorization": f"Bearer {tiny_replicated.api_key}"}
    def slots() -> dict:
        return httpx.get(tiny_replicated.url + "/slots", headers=key, timeout=10).json()

    # Replicas report their slots every second: the last test's end arrives within a report or two.
    wait_for(lambda: slots()["slots"] == [], 10, "empty slots", tiny_replicated)
    assert slots()["max_batch"] == 2 * 8  # two replicas' slots
    page = httpx.get(tiny_replicated.url + "/", timeout=10)
    assert page.status_code == 200 and 'fetch("/slots"' in page.text
    bad = httpx.post(tiny_replicated.url + "/v1/chat/completions", headers=key, json={"messages": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"  # the replica's own shape


def test_concurrent_requests_reach_both_replicas_and_a_shared_prefix_sticks(tiny_replicated):
    def served_by_each() -> dict:
        return {r["replica"]: counter(tiny_replicated, "specee_requests_total", replica=r["replica"],
                                      route="/v1/chat/completions") for r in tiny_replicated.replicas()}

    # Replicas report their metrics every second: counts that stay the same over 1.5 s have the last
    # test's requests in them.
    before = served_by_each()
    while True:
        time.sleep(1.5)
        if before == (before := served_by_each()):
            break
    c = client(tiny_replicated)

    def ask(i: int) -> str:
        return c.chat.completions.create(model=None, max_tokens=8, messages=[
            {"role": "user", "content": f"{PROMPTS[i % 4]} ({i})"}]).choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        assert all(reason in ("stop", "length") for reason in pool.map(ask, range(16)))
    wait_for(lambda: sum(served_by_each().values()) >= sum(before.values()) + 16, 10, "16 requests in the metrics",
             tiny_replicated)
    after = served_by_each()
    served = {r: after[r] - before[r] for r in before}
    assert sum(served.values()) == 16 and all(n > 0 for n in served.values()), served
    assert counter(tiny_replicated, "specee_requests_total", replica="all", route="/v1/chat/completions") == \
        sum(after.values())
    # One conversation's turns share its long system message: after the first, prefix routing
    # keeps them on one replica (the requests are sequential, so neither replica is busier).
    prefix_before = counter(tiny_replicated, "specee_routed_requests_total", reason="prefix")
    for prompt in PROMPTS:
        c.chat.completions.create(model=None, max_tokens=4, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])
    assert counter(tiny_replicated, "specee_routed_requests_total", reason="prefix") - prefix_before == 3


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_ctrl_c_in_a_terminal_stops_a_local_ray_gracefully(tiny_replicated, tiny):
    """Ctrl-C reaches the whole foreground process group, where a local Ray's processes live too:
    they must outlive it long enough for the replicas to stop in order, and then go. The module's
    cluster runs meanwhile, its CPUs taken by its replicas: without --address the command starts a Ray of its own
    rather than join the cluster `ray start` left on this machine (where its replica would wait)."""
    port = serve_port()  # its own Ray's processes take kernel-picked ports
    command = [sys.executable, "-m", "specee.cli", "serve", "--port", str(port), "--model", tiny, "--replicas", "1",
               "--threads", "1"]  # no --address: a local Ray that stops with the command
    server = subprocess.Popen(command, cwd=ROOT, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not healthy(port):
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the replica never answered /health"
            time.sleep(0.5)
        os.killpg(server.pid, signal.SIGINT)  # as a terminal does
        code = server.wait(120)
        stderr = server.stderr.read()
        assert code == 0, stderr[-4000:]
        assert "replicas finish their running requests" in stderr
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
