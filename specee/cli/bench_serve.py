"""`specee bench-serve`: load-test `specee serve` side by side with llama.cpp's server."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..options import LoadOptions, from_namespace, positive_int
from . import loading
from .common import UsageError, writable
from .loading import add_model_options


def add_parser(sub) -> None:
    load = sub.add_parser("bench-serve", help="load-test `specee serve` side by side with llama.cpp's server: requests/s, "
                          "tokens/s, time to first token and peak memory at 1 to 16 clients")
    add_model_options(load)
    load.add_argument("--url", help="a running specee server (default: start one with the model options)")
    load.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated client counts (default 1,2,4,8,16)")
    load.add_argument("--scenario", choices=["requests", "chat", "agent"], default="requests",
                      help="requests: short independent requests; chat: six-turn MT-Bench conversations that resend "
                           "their history; agent: a ~1,000-token system prompt and five tool-loop calls (default requests)")
    load.add_argument("--requests-per-client", type=positive_int, default=2,
                      help="requests each client sends in the requests scenario (default 2)")
    load.add_argument("--conversations", type=positive_int,
                      help="chat/agent: conversations per run, dealt round the clients (default: the most clients)")
    load.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens per answer (default 64)")
    load.add_argument("--modes", default="dense,hybrid-tree,llama.cpp",
                      help="comma-separated: dense, auto, prompt-lookup, hybrid-tree, dense-no-prefix-cache (specee's "
                           "modes), llama.cpp (default dense,hybrid-tree,llama.cpp)")
    load.add_argument("--max-batch", type=positive_int,
                      help="specee serve --max-batch: generations sharing each model pass (default: the server's)")
    load.add_argument("--parallel", type=positive_int,
                      help="llama-server's slots, -np (default: the largest --concurrency)")
    load.add_argument("--llama-server", help="llama.cpp's llama-server executable (default: where "
                      "scripts/build_llama_server.sh installs it; without one, llama-cpp-python's server if installed)")
    load.add_argument("--rounds", type=positive_int, default=1,
                      help="run specee's modes at every concurrency N times, interleaved, each keeping its fastest "
                           "round, and note each mode against the first round by round (default 1)")
    load.add_argument("--out", default="bench-serve.json",
                      help="JSON output file, the plot beside it; a folder: bench-serve.json in it (default bench-serve.json)")


def run(args) -> int:
    if importlib.util.find_spec("openai") is None:
        raise UsageError('specee bench-serve sends its requests with the openai client: pip install "specee[bench]"')
    from ..eval.llama_cpp_server import model_gguf
    from ..eval.serve_bench import SYSTEMS, ServeBenchConfig, run_serve_bench

    unknown = set(args.modes.split(",")) - set(SYSTEMS)
    if unknown:
        raise UsageError(f"unknown --modes {sorted(unknown)} (choose from {', '.join(SYSTEMS)})")
    try:
        concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency takes comma-separated client counts, got {args.concurrency!r}") from None
    if min(concurrency) < 1:
        raise UsageError(f"--concurrency counts must be positive, got {args.concurrency!r}")
    out = Path(args.out) / "bench-serve.json" if Path(args.out).is_dir() else Path(args.out)
    writable(out, "--out", folder=False)
    if args.llama_server and not Path(args.llama_server).is_file():
        raise UsageError(f"--llama-server {args.llama_server!r} is not a file (build it: bash scripts/build_llama_server.sh)")
    engine = loading.load(args)
    config = ServeBenchConfig(
        concurrency=concurrency, requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
        modes=args.modes.split(","), url=args.url, out=out,
        threads=args.threads or __import__("torch").get_num_threads(), max_batch=args.max_batch, parallel=args.parallel,
        gguf=model_gguf(args.model), llama_server=Path(args.llama_server) if args.llama_server else None,
        scenario=args.scenario, conversations=args.conversations, rounds=args.rounds)
    # The server loads the model as this command did; the benchmark sets its threads, and each mode its prefix cache.
    model_flags = from_namespace(LoadOptions, args).flags(leave_out=("threads", "ctx_size", "prefix_cache_mb"))
    run_serve_bench(engine, config, model_flags)
    return 0
