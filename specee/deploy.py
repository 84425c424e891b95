"""The import path a Ray Serve config names (deploy/serve.yaml): `specee.deploy:build`. Its `args`
are `specee serve`'s options with underscores, checked as the command line checks them."""
from __future__ import annotations


def build(args: dict):
    from .cli import cluster_application, parse_serve_flags, serve_flags

    try:
        options = parse_serve_flags(serve_flags(dict(args)))
    except SystemExit:  # argparse has said why on stderr; Ray reports an exception, not an exit
        raise ValueError(f"bad specee serve options in the Ray Serve config: {args}") from None
    return cluster_application(options)
