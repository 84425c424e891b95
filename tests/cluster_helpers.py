"""A two-node Ray cluster on this machine (one CPU per node, so one replica per node) and
`specee serve --replicas 2` on it, for tests/test_cluster*.py. One specee application runs on a
cluster at a time (Serve has one HTTP proxy and the app takes the root route)."""
import os
import random
import socket
import sys
import time

import httpx

from serve_helpers import ROOT
from specee.eval.server_process import ChildServer
from tiers import require_slow

ENV = dict(os.environ, PYTHONPATH=str(ROOT))
PROMPTS = ["Name three colours.", "What is 2+2?", "Write a haiku about rain.", "Say hello in French."]
# Six 128-character blocks of the router's table in common: prefix routing's threshold is two.
SYSTEM = "You are a terse assistant for a hardware shop; answer in one line. " * 12


# Ray's processes bind ports the kernel picks (its ephemeral range, 32768 and up here) and its
# workers take 10002-19999: a Serve port from the kernel's free_port() was taken by one of them
# between the test's pick and the proxy's bind ("Failed to bind to address"). Serve ports come
# from between the two.
SERVE_PORTS = range(20000, 32768)


def serve_port() -> int:
    """A port for Ray Serve's HTTP proxy that no Ray process draws for itself, free now."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in random.sample(SERVE_PORTS, 200):
        if port >= low:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for Ray Serve below the ephemeral range")


def ray_cluster_fixture():
    require_slow("a Ray cluster")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    # Ray Serve keeps the first HTTP address it was started with on a cluster (for a while after
    # `serve shutdown`, too): every application here uses the same one.
    cluster.serve_port = serve_port()
    yield cluster
    cluster.shutdown()


class Replicated(ChildServer):
    """`specee serve --replicas 2 --address <cluster>`, healthy once both replicas report."""

    def __init__(self, cluster, *flags: str, api_key: str | None = None) -> None:
        port, address = cluster.serve_port, cluster.address
        self.api_key = api_key or "unused"
        flags = (*flags, "--api-key", api_key) if api_key else flags
        command = [sys.executable, "-m", "specee.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--replicas", "2", "--threads", "1", "--address", address, *flags]
        super().__init__(command, port, cwd=ROOT, env=ENV)
        wait_for(lambda: len(self.replicas()) == 2, 180, "two replicas", self)

    def replicas(self) -> list[dict]:
        response = httpx.get(self.url + "/health", timeout=10)
        return response.json()["replicas"] if response.status_code == 200 else []


def wait_for(condition, seconds: float, what: str, server: ChildServer) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {seconds} s:\n{server.output()[-4000:]}")
        time.sleep(0.5)


def client(server):
    import openai  # imported where used, not at collection

    return openai.OpenAI(base_url=server.url + "/v1", api_key=getattr(server, "api_key", "unused"), max_retries=0,
                         timeout=300)


def answers(server, max_tokens: int) -> list:
    """Greedy and seeded answers, whole and streamed, per prompt: (text, finish, completion tokens)."""
    c = client(server)
    out = []
    for prompt in PROMPTS:
        for sampling in ({}, {"temperature": 0.8, "seed": 11}):
            messages = [{"role": "user", "content": prompt}]
            whole = c.chat.completions.create(model=None, messages=messages, max_tokens=max_tokens, **sampling)
            parts = list(c.chat.completions.create(model=None, messages=messages, max_tokens=max_tokens,
                                                   stream=True, **sampling))
            streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
            out.append((whole.choices[0].message.content, whole.choices[0].finish_reason,
                        whole.usage.completion_tokens, streamed))
    return out


def counter(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


