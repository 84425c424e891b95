"""`specee serve`: the OpenAI-compatible server in this process, or on Ray Serve replicas
(--replicas). Its options are declared once here (`ServeOptions`, `ClusterOptions`) beside the
model's (`LoadOptions`) and the requests' defaults (`SamplingOptions`, `SpecConfig`): the flags come
from them, and so does a Ray Serve config's application (`options_from_config`, `specee.deploy`)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..batch import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK
from ..options import (
    LoadOptions,
    add_flags,
    converted,
    from_namespace,
    non_negative_int,
    option,
    positive_int,
)
from . import loading
from .common import UsageError
from .loading import add_model_options
from .sampling import (
    SamplingOptions,
    add_sampling_options,
    sampling_kwargs,
    validate_sampling,
)


def replicas_count(text: str) -> int | str:
    return text if text == "auto" else positive_int(text)


@dataclass(frozen=True)
class ServeOptions:
    host: str = option("127.0.0.1", "address to bind (default 127.0.0.1, this machine only)")
    port: int = option(8000, "port (default 8000)", parse=non_negative_int)
    api_key: str | None = option(help="require Authorization: Bearer KEY on /v1 routes (default: $SPECEE_API_KEY)")
    max_queue: int = option(64, "requests that may wait; more get 503 with Retry-After (default 64)", parse=positive_int)
    max_batch: int = option(DEFAULT_MAX_BATCH, "generations that share each pass of the model; more requests wait in "
                                               "the queue (default {default})", parse=positive_int)
    prefill_chunk: int = option(DEFAULT_PREFILL_CHUNK, "the most prompt tokens of a new request in one shared pass, so "
                                                       "a long prompt does not stall the others (default {default})",
                                parse=positive_int)
    request_timeout: float = option(300.0, "seconds a request may take, queueing included (default 300)", parse=float)
    body_timeout: float = option(30.0, "seconds a request's body may take to arrive; slower ones get 408 (default 30)",
                                 parse=float)
    keep_alive_timeout: float = option(5.0, "seconds an idle connection is kept open, and the most a request's headers "
                                            "may take to arrive (uvicorn's --timeout-keep-alive; default 5)", parse=float)
    shutdown_grace: float = option(30.0, "after SIGTERM, seconds running requests may take to finish; streams still "
                                         "running at the end get an error event and [DONE] (default 30)", parse=float)


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int | str | None = option(
        help="serve through Ray Serve with N replicas, each with its own engine on --threads cores, or auto: as many "
             "as the load asks for, between --min-replicas and --max-replicas (default: one process, no Ray)",
        parse=replicas_count)
    min_replicas: int = option(1, "--replicas auto: the fewest (default 1)", parse=positive_int)
    max_replicas: int = option(4, "--replicas auto: the most (default 4)", parse=positive_int)
    target_ongoing: int | None = option(help="--replicas auto: ongoing requests per replica to scale at (default: "
                                             "--max-batch)", parse=positive_int)
    routing: str = option("prefix", "--replicas: prefix sends a request whose prompt begins as a replica's recent ones "
                                    "did to that replica (its prefix cache has them), unless it is busier than the "
                                    "others; fewest: always the replica with the fewest ongoing requests (default "
                                    "prefix)", choices=("prefix", "fewest"))
    address: str | None = option(help="with --replicas: join this Ray cluster (auto, or the head's host:port); "
                                      "default: start a local Ray that stops with the command")


def add_parser(sub) -> None:
    add_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a live page at /"))


def add_arguments(serve: argparse.ArgumentParser) -> None:
    add_model_options(serve)
    add_sampling_options(serve)  # the defaults of requests that leave these out
    add_flags(serve, ServeOptions, {"api_key": os.environ.get("SPECEE_API_KEY")})
    add_flags(serve.add_argument_group("scale-out on Ray Serve (pip install -e \".[cluster]\")"), ClusterOptions)


def run(args) -> int:
    if any(importlib.util.find_spec(name) is None for name in ("fastapi", "uvicorn", "prometheus_client")):
        raise UsageError("specee serve needs its extra: pip install 'specee[serve]'")
    validate_serve_args(args)
    if args.replicas is not None:
        return serve_on_ray(args)
    from ..server.app import bind, model_id_of, serve

    try:
        listening = bind(args.host, args.port)  # a busy port fails now, not after the model loads
    except OSError as e:
        raise UsageError(str(e)) from None
    with listening:
        engine = loading.load_off_main_thread(args)
        serve(engine, server_config(args, model_id_of(engine)), listening)
    return 0


def validate_serve_args(args) -> None:
    validate_sampling(args)
    for flag in ("request_timeout", "body_timeout", "keep_alive_timeout", "shutdown_grace"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("the API key is empty (--api-key or SPECEE_API_KEY): give a key, or unset it to serve "
                         "without one")
    if args.replicas is None and args.address is not None:
        raise UsageError("--address joins a Ray cluster and needs --replicas")
    if args.min_replicas > args.max_replicas:
        raise UsageError(f"--min-replicas {args.min_replicas} is above --max-replicas {args.max_replicas}")
    import ipaddress

    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not args.api_key:
        print(f"specee: warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)


def server_config(args, model_id: str = "specee"):
    """The server's settings from `specee serve`'s flags."""
    from ..server.app import ServerConfig
    from ..server.completions import Defaults

    return ServerConfig(
        model_id=model_id, defaults=Defaults(sampling_kwargs(args), args.config),
        api_key=args.api_key, max_queue=args.max_queue, request_timeout=args.request_timeout,
        max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, body_timeout=args.body_timeout,
        keep_alive=args.keep_alive_timeout, shutdown_grace=args.shutdown_grace,
    )


def options_from_config(given: dict) -> argparse.Namespace:
    """`specee serve`'s options from a Ray Serve config's `args` (the flags' names with underscores;
    what is left out keeps the flag's default), each value converted and checked as its flag's text
    would be, then all of them as the command checks them."""
    from ..strategies.config import all_fields, flag, keyword, value_type

    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    args = defaults.parse_args([])
    declared = {f.name: f for options in (LoadOptions, SamplingOptions, ServeOptions, ClusterOptions)
                for f in fields(options)}
    decoding = {keyword(f): value_type(f) for f in all_fields() if flag(f) is not None}
    unknown = sorted(set(given) - set(declared) - set(decoding))
    if unknown:
        raise UsageError(f"not a specee serve option: {', '.join(unknown)}")
    for name, value in given.items():
        if value is None:
            continue
        try:
            value = converted(declared[name], value, name) if name in declared else decoding[name](str(value))
        except ValueError as e:
            raise UsageError(str(e) if name in declared else f"{name}: {e}") from None
        setattr(args, name, value)
    validate_serve_args(args)
    return args


def cluster_application(args):
    """The Ray Serve application `specee serve --replicas` runs (and a Ray Serve config builds:
    `specee.deploy`)."""
    from ..cluster.app import ReplicaSpec, application
    from ..model.cores import physical_cores

    threads = args.threads
    if threads is None:  # share this machine's cores among the replicas
        most = args.max_replicas if args.replicas == "auto" else args.replicas
        threads = max(1, physical_cores() // max(1, most))
    load = replace(from_namespace(LoadOptions, args), threads=threads)
    return application(ReplicaSpec(load, server_config(args), threads), args.replicas, args.min_replicas,
                       args.max_replicas, args.target_ongoing, args.routing)


def serve_on_ray(args) -> int:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise UsageError("--replicas serves through Ray Serve, which is not installed: pip install -e \".[cluster]\" "
                         "(or pip install \"ray[serve]\")")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"--model {args.model!r} does not exist")  # before Ray starts, not in each replica
    from ..cluster.launch import run as run_cluster

    app = cluster_application(args)
    try:
        return run_cluster(app, args.host, args.port, args.address, args.replicas, args.shutdown_grace)
    except OSError as e:
        raise UsageError(str(e)) from None
