"""The Ray Serve application from `specee serve`'s options: `build` is the import path a Ray Serve
config names (deploy/serve.yaml), `application` what `specee serve --replicas` runs."""
from __future__ import annotations

import os

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..cli import CLUSTER_FLAGS, UsageError, parse_serve_flags, serve_flags
from .ingress import Ingress
from .replica import Replica
from .router import PrefixAffinityRouter

INGRESS = "Ingress"
HEALTH_CHECK_S = 2.0  # a dead scheduler is found this soon
# No line per request (each replica reports to the ingress every second); warnings and errors stay.
QUIET = {"enable_access_log": False}


def application(options: dict) -> serve.Application:
    """options: `specee serve`'s option dests (as argparse names them) and values."""
    flags = serve_flags({k: v for k, v in options.items() if k not in CLUSTER_FLAGS})
    args = parse_serve_flags(flags)  # bad options fail here, before any replica starts
    replicas = options.get("replicas")
    replicas = 1 if replicas is None else replicas
    if replicas == "auto":
        scaling = {"autoscaling_config": {"min_replicas": options.get("min_replicas", 1),
                                          "max_replicas": options.get("max_replicas", 4),
                                          "target_ongoing_requests": options.get("target_ongoing") or args.max_batch}}
    elif isinstance(replicas, int) and not isinstance(replicas, bool) and replicas > 0:
        scaling = {"num_replicas": replicas}
    else:
        raise UsageError(f"replicas must be a positive number or auto, got {replicas!r}")
    if args.threads is None:  # share this machine's cores
        most = options.get("max_replicas", 4) if replicas == "auto" else replicas
        args.threads = max(1, (os.cpu_count() or 1) // most)
        flags += ["--threads", str(args.threads)]
    replica = serve.deployment(Replica, name="Replica").options(
        ray_actor_options={"num_cpus": args.threads},
        # Requests beyond a replica's batch wait in its own queue, which answers 503 when full.
        max_ongoing_requests=args.max_batch + args.max_queue,
        graceful_shutdown_timeout_s=args.shutdown_grace, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=HEALTH_CHECK_S, max_constructor_retry_count=1,
        logging_config=QUIET,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"prefix": options.get("routing", "prefix") == "prefix"}),
        **scaling)
    ingress = serve.deployment(Ingress, name=INGRESS).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000, logging_config=QUIET,
        graceful_shutdown_timeout_s=args.shutdown_grace + 5)
    return ingress.bind(replica.bind(flags, INGRESS), api_key=args.api_key)


def build(args: dict) -> serve.Application:
    """A Ray Serve config's application builder: `args` are `specee serve`'s options with underscores."""
    return application(dict(args))
