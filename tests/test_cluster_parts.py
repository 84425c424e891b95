"""The parts of `specee serve --replicas` that need no Ray cluster: the options a replica gets,
forwarding a request through a replica's app in process, the routing decision, the merged
metrics, and the error without Ray. The cluster itself: tests/test_cluster.py (slow)."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import specee
from helpers import tiny_model_directory
from specee.cli import UsageError, build_parser, main
from specee.cli.serve import options_from_config, validate_serve_args
from specee.cluster import metrics
from specee.cluster.asgi import Forwarded, Start, call, routing_text
from specee.server.app import ServerConfig, create_app
from specee.server.completions import Defaults

ROOT = Path(__file__).resolve().parent.parent


def test_a_ray_serve_configs_options_are_what_the_same_flags_give():
    flags = ["--max-batch", "3", "--stop", "a", "--stop", "b", "--no-compile", "--temperature", "0.5",
             "--prefix-cache-mb", "0", "--api-key", "k", "--replicas", "auto", "--spec-method", "ngram",
             "--tree-budget", "4", "--threads", "2"]
    given = {"max_batch": 3, "stop": ["a", "b"], "compile": False, "temperature": 0.5, "prefix_cache_mb": 0,
             "api_key": "k", "replicas": "auto", "spec_method": "ngram", "tree_budget": 4, "threads": 2}
    parsed = build_parser().parse_args(["serve", *flags])
    validate_serve_args(parsed)
    from_config = options_from_config(given)
    for dest, value in vars(from_config).items():
        assert getattr(parsed, dest) == value, dest
    with pytest.raises(UsageError, match="not a specee serve option: max_batchh"):
        options_from_config({"max_batchh": 2})
    for bad, message in (({"threads": 0}, "threads: must be a positive integer"),
                         ({"compile": "no"}, "compile takes true or false"), ({"stop": "a"}, "stop takes a list"),
                         ({"routing": "random"}, "routing: 'random' is not one of prefix, fewest"),
                         ({"tree_budget": "many"}, "tree_budget: invalid literal")):
        with pytest.raises(UsageError, match=message):
            options_from_config(bad)


def test_replicas_without_ray_exit_2_with_the_install_hint(capsys):
    hide_ray = ("import sys; sys.modules['ray'] = None; from specee.cli import main; "
                "sys.exit(main(['serve', '--replicas', '2']))")
    done = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert 'pip install -e ".[cluster]"' in done.stderr and "Traceback" not in done.stderr
    assert main(["serve", "--address", "auto"]) == 2
    assert "--address joins a Ray cluster and needs --replicas" in capsys.readouterr().err


def test_the_ingress_holds_no_model_and_imports_no_torch():
    """Ray starts the ingress in a process of its own beside the replicas: without torch it starts
    in about half the time and memory."""
    done = subprocess.run([sys.executable, "-c", "import sys, specee.cluster.ingress; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    engine = specee.load(str(tiny_model_directory(tmp_path_factory.mktemp("tiny"), seed=3)), quantization="none",
                         compile=False)
    return create_app(engine, ServerConfig("tiny", Defaults({"max_tokens": 6})))


def forwarded(body: dict, path: str = "/v1/chat/completions") -> Forwarded:
    raw = json.dumps(body).encode()
    return Forwarded("POST", path, b"", [(b"content-type", b"application/json")], raw, routing_text(path, raw))


def through(app, request: Forwarded) -> tuple[Start, bytes]:
    async def run():
        parts = [part async for part in call(app, request)]
        return parts[0], b"".join(parts[1:])
    return asyncio.run(run())


def test_a_forwarded_request_gets_what_the_app_answers_over_http(app):
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    with TestClient(app) as client:  # starts the scheduler, as a replica does
        direct = client.post("/v1/chat/completions", json=chat).json()
        direct_stream = client.post("/v1/chat/completions", json=chat | {"stream": True}).text
        start, body = through(app, forwarded(chat))
        assert start.status == 200 and start.header(b"content-type") == b"application/json"
        answer = json.loads(body)
        assert answer["choices"] == direct["choices"] and answer["usage"] == direct["usage"]
        start, body = through(app, forwarded(chat | {"stream": True}))
        assert start.header(b"content-type").startswith(b"text/event-stream")
        events = [line for line in body.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        contents = lambda text: [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in text.split("\n\n")
                                 if e.startswith("data: {")]
        assert contents(body.decode()) == contents(direct_stream)
        bad = forwarded({"messages": "not a list"})
        start, body = through(app, bad)
        assert start.status == 400 and json.loads(body)["error"]["param"] == "messages"


def test_routing_text_is_the_prompt_and_grows_by_appending():
    first = [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "one"}]
    later = first + [{"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    a = routing_text("/v1/chat/completions", json.dumps({"messages": first}).encode())
    b = routing_text("/v1/chat/completions", json.dumps({"messages": later}).encode())
    assert "S" * 300 in a and a[:-2] == b[:len(a) - 2]  # all but the closing brackets
    assert routing_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert routing_text("/v1/chat/completions", b"{not json") == ""
    assert routing_text("/v1/models", b"") == ""


class Replica(SimpleNamespace):
    pass


def router_with(queue_lengths: dict[str, int | None]) -> tuple:
    from specee.cluster.router import PrefixAffinityRouter  # Ray Serve: imported where used, not at collection

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the Ray-side constructor needs a controller
    router.initialize_state()
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: queue_lengths[replica_id])
    return router, [Replica(replica_id=name) for name in queue_lengths]


def choose(router, candidates, text: str):
    request = SimpleNamespace(args=[SimpleNamespace(routing_text=text)], routing_context=SimpleNamespace())
    return asyncio.run(router.choose_replicas(candidates, request)), request


def test_a_prompt_goes_where_its_beginning_went_unless_that_replica_is_much_busier():
    from specee.cluster.router import BLOCK_CHARS, MIN_MATCH_BLOCKS, block_hashes

    router, (a, b) = router_with({"a": 0, "b": 0})
    shared = "x" * (BLOCK_CHARS * 4)
    router.tables["b"] = dict.fromkeys(block_hashes(shared + "first question"))
    ranks, request = choose(router, [a, b], shared + "second question")
    assert ranks == [[b], [a]] and request.routing_context.prefix_choice == "b"
    # A beginning shorter than MIN_MATCH_BLOCKS is no reason.
    ranks, _ = choose(router, [a, b], shared[:BLOCK_CHARS * (MIN_MATCH_BLOCKS - 1)] + "y" * BLOCK_CHARS * 3)
    assert ranks == [[a, b]]
    # Busier by more than the imbalance allowed: the least busy takes it.
    router._replica_queue_len_cache = SimpleNamespace(get={"a": 0, "b": router.imbalance + 1}.get)
    ranks, _ = choose(router, [a, b], shared + "third")
    assert ranks == [[a, b]]
    router.prefix = False
    router._replica_queue_len_cache = SimpleNamespace(get={"a": 0, "b": 0}.get)
    assert choose(router, [a, b], shared + "fourth")[0] == [[a, b]]


def test_block_hashes_chain_so_a_match_is_a_whole_common_beginning():
    from specee.cluster.router import BLOCK_CHARS, block_hashes

    one = block_hashes("a" * BLOCK_CHARS + "b" * BLOCK_CHARS)
    two = block_hashes("c" * BLOCK_CHARS + "b" * BLOCK_CHARS)
    assert len(one) == 2 and one[1] != two[1]  # the same second block after a different first
    assert block_hashes("a" * (BLOCK_CHARS - 1)) == []


def test_merged_metrics_label_each_replica_and_sum_them():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    def replica(requests: int, running: int, latency: float) -> str:
        r = CollectorRegistry()
        Counter("specee_requests", "r", ["status"], registry=r).labels("200").inc(requests)
        Gauge("specee_running_requests", "g", registry=r).set(running)
        Histogram("specee_latency_seconds", "h", buckets=(1, 5), registry=r).observe(latency)
        return generate_latest(r).decode()

    text = metrics.exposition({"r1": replica(3, 1, 0.5), "r2": replica(4, 2, 3.0)}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("specee_requests_total", (("replica", "r1"), ("status", "200")))] == 3
    assert samples[("specee_requests_total", (("replica", "all"), ("status", "200")))] == 7
    assert samples[("specee_running_requests", (("replica", "all"),))] == 3
    assert samples[("specee_latency_seconds_bucket", (("le", "1.0"), ("replica", "all")))] == 1
    assert samples[("specee_latency_seconds_count", (("replica", "all"),))] == 2
    assert not any(name.endswith("_created") for name, _ in samples)


def test_the_application_asks_ray_for_what_the_flags_say():
    from specee.deploy import build

    def replica_of(options: dict):
        ingress = build(options)._bound_deployment
        assert ingress.ray_actor_options["num_cpus"] == 0  # the ingress takes no core from a replica
        replica = ingress.init_args[0]._bound_deployment
        return replica, replica._deployment_config

    replica, config = replica_of({"replicas": 3, "threads": 2, "max_batch": 4, "max_queue": 10, "temperature": 0.5})
    assert config.num_replicas == 3 and replica.ray_actor_options["num_cpus"] == 2
    assert config.max_ongoing_requests == 14  # beyond the batch, the replica's own queue answers 503
    spec, _ = replica.init_args
    assert spec.load.threads == 2 and spec.server.max_batch == 4
    assert spec.server.defaults.generation["temperature"] == 0.5
    replica, config = replica_of({"replicas": "auto", "min_replicas": 2, "max_replicas": 5, "target_ongoing": 6})
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 5, 6)
    for bad in ({"replicas": 0}, {"max_batchh": 2}, {"min_replicas": 3, "max_replicas": 2}):
        with pytest.raises(Exception, match="replicas|not a specee serve option"):
            build(bad)
