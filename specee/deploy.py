"""The import path a Ray Serve config names (deploy/serve.yaml): `specee.deploy:build`. Its `args`
are `specee serve`'s options with underscores (the declared `LoadOptions`, `SamplingOptions`,
`ServeOptions`, `ClusterOptions` and decoding options), checked as the command line checks them."""
from __future__ import annotations


def build(args: dict):
    from .cli.common import UsageError
    from .cli.serve import cluster_application, options_from_config

    try:
        options = options_from_config(dict(args))
    except UsageError as e:  # Ray reports the exception
        raise ValueError(f"bad specee serve options in the Ray Serve config: {e}") from None
    return cluster_application(options)
