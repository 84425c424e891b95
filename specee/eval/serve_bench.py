"""`specee bench-serve`: a bounded load generator against `specee serve` (one it starts, or --url).

For each mode and each number of concurrent clients, every client sends a fixed number of
streaming chat requests one after another; it reports requests per second, time to first token
(p50/p95) and tokens per second per client. It also measures the server's own overhead on a single
request: the same request through HTTP and in this process, alternated, medians compared with the
engine's decode time. A benchmark, not a test: it prints, writes JSON, and asserts nothing."""
from __future__ import annotations

import json
import math
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, median

from ..engine import Engine
from .report import machine_info
from .server_process import ServerProcess

MODES = {"dense": {"spec_method": "none"}, "hybrid-tree": {"spec_method": "hybrid", "tree": "auto"}}
# Short everyday requests of several kinds (the answers stop at EOS or max_tokens, as a user's would).
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in two sentences: The city council met on Monday to discuss the new park. After a long "
    "debate, they approved the budget and agreed that construction will begin in the spring.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "What is 17 times 23? Explain the steps.",
    "Give three tips for writing clear emails.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
]
OVERHEAD_RUNS = 5
# A pause before each timed overhead run: the other process's idle OpenMP threads spin for a while
# after their last pass, and would slow this one.
IDLE_GAP_S = 0.5


@dataclass
class ServeBenchConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    requests_per_client: int = 2
    max_tokens: int = 64
    modes: list[str] = field(default_factory=lambda: list(MODES))
    url: str | None = None  # None: start a server with the model flags
    out: Path = Path("bench-serve.json")


@dataclass
class RequestRecord:
    mode: str
    clients: int
    client: int
    start_s: float  # since the run began
    first_token_s: float | None  # after start; None when no token came
    end_s: float  # since the run began
    completion_tokens: int


@dataclass
class LoadSummary:
    mode: str
    clients: int
    requests: int
    wall_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    tokens_per_s_per_client: float  # mean over clients of their tokens / their busy time


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summarize_load(mode: str, clients: int, records: list[RequestRecord], wall_s: float) -> LoadSummary:
    first_tokens = [r.first_token_s for r in records if r.first_token_s is not None]
    per_client = []
    for client in sorted({r.client for r in records}):
        mine = [r for r in records if r.client == client]
        busy = max(r.end_s for r in mine) - min(r.start_s for r in mine)
        per_client.append(sum(r.completion_tokens for r in mine) / busy if busy > 0 else 0.0)
    return LoadSummary(
        mode=mode, clients=clients, requests=len(records), wall_s=wall_s,
        requests_per_s=len(records) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile(first_tokens, 50) if first_tokens else float("nan"),
        ttft_p95_s=percentile(first_tokens, 95) if first_tokens else float("nan"),
        tokens_per_s_per_client=mean(per_client) if per_client else 0.0,
    )


def stream_chat(url: str, prompt: str, max_tokens: int, spec: dict) -> tuple[float | None, int]:
    """One streaming request: (seconds to the first token, completion tokens)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "specee": spec}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and chunk["specee"].get("tokens"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


def run_load(url: str, mode: str, clients: int, config: ServeBenchConfig) -> LoadSummary:
    began = time.perf_counter()

    def client_loop(client: int) -> list[RequestRecord]:
        records = []
        for i in range(config.requests_per_client):
            prompt = PROMPTS[(client + i) % len(PROMPTS)]
            start = time.perf_counter() - began
            first, tokens = stream_chat(url, prompt, config.max_tokens, MODES[mode])
            records.append(RequestRecord(mode, clients, client, start, first, time.perf_counter() - began, tokens))
        return records

    with ThreadPoolExecutor(clients) as pool:
        records = [r for batch in pool.map(client_loop, range(clients)) for r in batch]
    return summarize_load(mode, clients, records, time.perf_counter() - began)


def measure_overhead(url: str, engine: Engine, max_tokens: int) -> dict:
    """The same dense request, alternately through the server and in this process."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    engine.generate(messages, max_tokens=4)  # warm-up, untimed
    served, local, decode = [], [], []
    for _ in range(OVERHEAD_RUNS):
        time.sleep(IDLE_GAP_S)
        start = time.perf_counter()
        stream_chat(url, PROMPTS[0], max_tokens, MODES["dense"])
        served.append(time.perf_counter() - start)
        time.sleep(IDLE_GAP_S)
        start = time.perf_counter()
        result = engine.generate(messages, max_tokens=max_tokens)
        local.append(time.perf_counter() - start)
        decode.append(result.stats.decode_s)
    return overhead_summary(served, local, decode)


def overhead_summary(served: list[float], local: list[float], decode: list[float]) -> dict:
    extra = median(served) - median(local)
    return {"server_s": median(served), "in_process_s": median(local), "decode_s": median(decode),
            "overhead_s": extra, "overhead_of_decode": extra / median(decode)}


def format_table(summaries: list[LoadSummary], overhead: dict) -> str:
    lines = [f"{'mode':<12} {'clients':>7} {'requests':>8} {'req/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} "
             f"{'tok/s per client':>17}"]
    for s in summaries:
        lines.append(f"{s.mode:<12} {s.clients:>7} {s.requests:>8} {s.requests_per_s:>7.2f} {s.ttft_p50_s:>8.3f}s "
                     f"{s.ttft_p95_s:>8.3f}s {s.tokens_per_s_per_client:>17.1f}")
    lines.append(f"server overhead on one request: {overhead['server_s']:.3f} s served vs {overhead['in_process_s']:.3f} s "
                 f"in process = {overhead['overhead_s'] * 1000:+.1f} ms, {overhead['overhead_of_decode']:+.1%} of the "
                 f"{overhead['decode_s']:.3f} s decode (target < 5%)")
    return "\n".join(lines)


def run_serve_bench(engine: Engine, config: ServeBenchConfig, server_flags: list[str]) -> dict:
    server = None if config.url else ServerProcess(*server_flags, "--max-queue", str(max(config.concurrency) * 2))
    url = config.url or server.url
    try:
        stream_chat(url, PROMPTS[0], 4, MODES["dense"])  # warm-up, untimed
        summaries = [run_load(url, mode, clients, config) for mode in config.modes for clients in config.concurrency]
        overhead = measure_overhead(url, engine, config.max_tokens)
    finally:
        if server is not None:
            server.stop()
    print(format_table(summaries, overhead))
    report = {"config": {**asdict(config), "out": str(config.out), "prompts": len(PROMPTS)},
              "machine": machine_info(), "load": [asdict(s) for s in summaries], "overhead": overhead}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return report
