"""The Ray Serve application: an ingress and `Replica`s built from a `ReplicaSpec`, with the
deployment options that `specee serve --replicas` (or a Ray Serve config, `specee.deploy`) asks for."""
from __future__ import annotations

from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..options import LoadOptions
from ..server.app import ServerConfig
from .ingress import Ingress
from .replica import Replica
from .router import PrefixAffinityRouter

INGRESS = "Ingress"
HEALTH_CHECK_S = 2.0  # a dead scheduler is found this soon
# No line per request (each replica reports to the ingress every second); warnings and errors stay.
QUIET = {"enable_access_log": False}


@dataclass
class ReplicaSpec:
    """What each replica builds: the model as `load` says and the server's settings (its model_id
    is filled in from the loaded model)."""

    load: LoadOptions
    server: ServerConfig
    threads: int


def application(spec: ReplicaSpec, replicas: int | str = 1, min_replicas: int = 1, max_replicas: int = 4,
                target_ongoing: int | None = None, routing: str = "prefix") -> serve.Application:
    if replicas == "auto":
        scaling = {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                          "target_ongoing_requests": target_ongoing or spec.server.max_batch}}
    elif isinstance(replicas, int) and not isinstance(replicas, bool) and replicas > 0:
        scaling = {"num_replicas": replicas}
    else:
        raise ValueError(f"replicas must be a positive number or auto, got {replicas!r}")
    server = spec.server
    replica = serve.deployment(Replica, name="Replica").options(
        ray_actor_options={"num_cpus": spec.threads},
        # Requests beyond a replica's batch wait in its own queue, which answers 503 when full.
        max_ongoing_requests=server.max_batch + server.max_queue,
        graceful_shutdown_timeout_s=server.shutdown_grace, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=HEALTH_CHECK_S, max_constructor_retry_count=1, logging_config=QUIET,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs={"prefix": routing == "prefix"}),
        **scaling)
    ingress = serve.deployment(Ingress, name=INGRESS).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000, logging_config=QUIET,
        graceful_shutdown_timeout_s=server.shutdown_grace + 5)
    return ingress.bind(replica.bind(spec, INGRESS), api_key=server.api_key)
