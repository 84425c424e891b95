"""`specee bench-serve`: a bounded load generator against `specee serve` and llama.cpp's server.

For each system (specee's modes, llama.cpp) and each number of concurrent clients, every client
sends streaming chat requests one after another with the official `openai` client, stopping at EOS
or max_tokens as a user's would: short independent requests (scenario `requests`), or whole
conversations that resend their history each turn (`chat`, `agent`: serve_scenarios.py). It
reports requests per second, aggregate and per-client tokens per second, time to first token
(p50/p95, and from the fourth turn on, where a prefix cache pays) and the server's peak memory. Each
specee run has a server of its own, so no run is served from another's caches and every mode
answers the same prompts: the notes say whether the modes' (greedy) answers matched. It
also measures specee's own overhead on a single request: each served request's time less the
server's own prefill and decode of it (the usage chunk's `specee.stats`), against the decode time of
the same request in this process, the two alternated. A benchmark, not a test: it
prints, writes JSON and a plot, and asserts nothing."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from itertools import count
from pathlib import Path
from statistics import mean, median
from typing import NamedTuple

import torch
from openai import OpenAI

from ..engine import Engine
from . import llama_cpp_server, serve_scenarios
from .bench import rotated
from .report import machine_info
from .server_process import ServerProcess, process_peak_rss_mb, reset_peak_rss

MODES = {"dense": {"spec_method": "none"}, "auto": {"spec_method": "auto"},
         "prompt-lookup": {"spec_method": "prompt-lookup"}, "hybrid-tree": {"spec_method": "hybrid", "tree": "auto"},
         "dense-no-prefix-cache": {"spec_method": "none", "prefix_cache": False}}
LLAMA_CPP = "llama.cpp"
SYSTEMS = [*MODES, LLAMA_CPP]  # what --modes may name
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
REQUEST_TIMEOUT_S = 600
LATE_TURN = 4  # a conversation's turns from here on are where a prefix cache should pay most
# Context per llama-server slot beyond max_tokens: the short requests with the chat template, or a
# whole conversation's history (the agent's ~1,000-token system prompt and five calls).
PROMPT_ROOM = {"requests": 512, "chat": 3072, "agent": 3072}
_run_tags = count(1)  # a tag per run on a shared server (--url), so that no run finds another's text in its caches


@dataclass
class ServeBenchConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    requests_per_client: int = 2
    max_tokens: int = 64
    modes: list[str] = field(default_factory=lambda: list(SYSTEMS))
    url: str | None = None  # a running specee server; None: start one with the model flags
    out: Path = Path("bench-serve.json")
    threads: int = field(default_factory=torch.get_num_threads)  # every server's CPU threads
    max_batch: int | None = None  # specee serve --max-batch; None: the server's own default
    parallel: int | None = None  # llama-server's slots (-np); None: the largest concurrency
    gguf: Path | None = None  # the model file llama.cpp serves; None: llama.cpp is skipped
    llama_server: Path | None = None  # llama-server's executable; None: where the build script puts it
    scenario: str = "requests"  # serve_scenarios.SCENARIOS
    conversations: int | None = None  # chat/agent: per run, shared among the clients; None: the most clients
    rounds: int = 1  # specee's modes run every concurrency this many times, interleaved; the fastest counts

    @property
    def slots(self) -> int:
        return self.parallel or max(self.concurrency)

    @property
    def conversation_count(self) -> int:
        return self.conversations or max(self.concurrency)


@dataclass
class Target:
    """A running server the load goes to."""
    system: str  # the table's system/mode: "specee dense", "llama.cpp"
    server: str  # which server ran, with its batching flag
    url: str
    model: str | None = None  # the id its /v1/models gives
    extra_body: dict | None = None  # specee's options; llama.cpp gets none
    pid: int | None = None  # for its peak memory; None: a server this process did not start


@dataclass
class RequestRecord:
    client: int
    start_s: float  # since the run began
    first_token_s: float | None  # after start; None when no content came
    end_s: float  # since the run began
    completion_tokens: int
    turn: int = 1  # the request's turn in its conversation
    prompt_tokens: int | None = None  # as the server's usage reports them
    cached_tokens: int | None = None  # prompt tokens the server took from its cache, where it says
    seen: bool = False  # its conversation's task was sent before in the run (serve_scenarios.Script.seen)
    text: str = ""  # the answer, for comparing the modes' answers


@dataclass
class LoadSummary:
    system: str
    server: str
    clients: int
    requests: int
    completion_tokens: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float  # aggregate: every completion token over the wall time
    tokens_per_s_per_client: float  # mean over clients of their tokens / their busy time
    ttft_p50_s: float
    ttft_p95_s: float
    peak_rss_mb: float | None  # the server's VmHWM over this run; None: not measured
    late_ttft_p50_s: float = float("nan")  # requests of turn LATE_TURN and later; nan: none
    late_ttft_p95_s: float = float("nan")
    prompt_tokens_mean: float = float("nan")
    cached_share: float | None = None  # cached prompt tokens over prompt tokens; None: not reported
    # Completion tokens over the requests' own time (start to end), for the calls of conversations
    # whose task the run sent before and for the others: what a cache of earlier answers can give.
    seen_tokens_per_s: float = float("nan")
    unseen_tokens_per_s: float = float("nan")
    # The answers, client by client in the order sent (a digest): greedy modes given the same
    # prompts answer alike, and any that does not is named in the notes.
    answers: str = ""


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summarize_load(target: Target, clients: int, records: list[RequestRecord], wall_s: float,
                   peak_rss_mb: float | None = None) -> LoadSummary:
    first_tokens = [r.first_token_s for r in records if r.first_token_s is not None]
    per_client = []
    for client in sorted({r.client for r in records}):
        mine = [r for r in records if r.client == client]
        busy = max(r.end_s for r in mine) - min(r.start_s for r in mine)
        per_client.append(sum(r.completion_tokens for r in mine) / busy if busy > 0 else 0.0)
    tokens = sum(r.completion_tokens for r in records)
    late = [r.first_token_s for r in records if r.turn >= LATE_TURN and r.first_token_s is not None]
    prompts = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    cached = [(r.cached_tokens, r.prompt_tokens) for r in records if r.cached_tokens is not None and r.prompt_tokens]
    seen, unseen = ([r for r in records if r.seen == flag] for flag in (True, False))
    return LoadSummary(
        system=target.system, server=target.server, clients=clients, requests=len(records), completion_tokens=tokens,
        wall_s=wall_s, requests_per_s=len(records) / wall_s if wall_s > 0 else 0.0,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        tokens_per_s_per_client=mean(per_client) if per_client else 0.0,
        ttft_p50_s=percentile(first_tokens, 50) if first_tokens else float("nan"),
        ttft_p95_s=percentile(first_tokens, 95) if first_tokens else float("nan"),
        peak_rss_mb=peak_rss_mb,
        late_ttft_p50_s=percentile(late, 50) if late else float("nan"),
        late_ttft_p95_s=percentile(late, 95) if late else float("nan"),
        prompt_tokens_mean=mean(prompts) if prompts else float("nan"),
        cached_share=sum(c for c, _ in cached) / sum(p for _, p in cached) if cached else None,
        seen_tokens_per_s=request_rate(seen), unseen_tokens_per_s=request_rate(unseen),
        answers=hashlib.sha256("\x00".join(r.text for r in records).encode()).hexdigest()[:16],
    )


def request_rate(records: list[RequestRecord]) -> float:
    """Completion tokens over the requests' summed durations; nan for none."""
    busy = sum(r.end_s - r.start_s for r in records)
    return sum(r.completion_tokens for r in records) / busy if busy > 0 else float("nan")


def open_client(url: str) -> OpenAI:
    # `specee serve` requires $SPECEE_API_KEY when it is set; llama.cpp's servers ignore the key.
    return OpenAI(base_url=url + "/v1", api_key=os.environ.get("SPECEE_API_KEY", "unused"), max_retries=0,
                  timeout=REQUEST_TIMEOUT_S)


class Reply(NamedTuple):
    first_token_s: float | None  # seconds to the first chunk carrying content; None: no content
    completion_tokens: int
    text: str
    prompt_tokens: int | None = None  # from the usage chunk, where the server sends one
    cached_tokens: int | None = None  # its prompt_tokens_details.cached_tokens, where it has them
    engine_s: float | None = None  # the server's own prefill + decode seconds (`specee.stats`), where it sends them


def stream_chat(client: OpenAI, target: Target, messages: list[dict], max_tokens: int) -> Reply:
    """One greedy streaming request. The tokens are the final usage chunk's; a server that sends
    none (llama-cpp-python's) streams one token per chunk, so its content chunks are counted instead."""
    start, first, usage, chunks, text, engine_s = time.perf_counter(), None, None, 0, [], None
    stream = client.chat.completions.create(
        model=target.model, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=target.extra_body)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            text.append(chunk.choices[0].delta.content)
            if first is None:
                first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
            stats = ((getattr(chunk, "model_extra", None) or {}).get("specee") or {}).get("stats")
            engine_s = stats["prefill_s"] + stats["decode_s"] if stats else None
    if usage is None:
        return Reply(first, chunks, "".join(text))
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Reply(first, usage.completion_tokens, "".join(text), usage.prompt_tokens, cached, engine_s)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run_load(target: Target, clients: int, config: ServeBenchConfig, tag: str | None = None) -> LoadSummary:
    """One run of the load. `tag` begins each conversation (a server shared by several runs would
    otherwise serve one run's prompts from another's caches)."""
    if target.pid is not None:
        reset_peak_rss(target.pid)  # where refused, the peak is the one since the server started
    conversations = None
    if config.scenario != "requests":
        scripts = serve_scenarios.scripts(config.scenario, config.conversation_count)
        conversations = [s.tagged(tag) for s in scripts] if tag else scripts
    began = time.perf_counter()

    def send(api: OpenAI, client: int, messages: list[dict], turn: int, records: list[RequestRecord],
             seen: bool = False) -> str:
        start = time.perf_counter() - began
        reply = stream_chat(api, target, messages, config.max_tokens)
        records.append(RequestRecord(client, start, reply.first_token_s, time.perf_counter() - began,
                                     reply.completion_tokens, turn, reply.prompt_tokens, reply.cached_tokens, seen,
                                     reply.text))
        return reply.text

    def client_loop(client: int) -> list[RequestRecord]:
        api, records = open_client(target.url), []
        if conversations is None:
            for i in range(config.requests_per_client):
                send(api, client, user(PROMPTS[(client + i) % len(PROMPTS)]), 1, records)
            return records
        for script in conversations[client::clients]:  # the conversations dealt round the clients
            messages = list(script.opening)
            for turn, text in enumerate(script.turns, 1):
                messages += user(text)
                messages.append({"role": "assistant", "content": send(api, client, messages, turn, records, script.seen)})
        return records

    with ThreadPoolExecutor(clients) as pool:
        records = [r for batch in pool.map(client_loop, range(clients)) for r in batch]
    wall_s = time.perf_counter() - began
    peak = process_peak_rss_mb(target.pid) if target.pid is not None else None
    return summarize_load(target, clients, records, wall_s, peak)


def warm_up(target: Target) -> Target:
    """The target with its model id, after one short untimed request."""
    api = open_client(target.url)
    ready = replace(target, model=api.models.list().data[0].id)
    stream_chat(api, ready, user(PROMPTS[0]), 4)
    return ready


def measure_overhead(target: Target, engine: Engine, max_tokens: int) -> dict:
    """The same dense request, alternately through the server and in this process. The overhead is
    each served request's time less the server's own prefill and decode of it: measured in one
    process, so the two processes' speeds (which drift apart on a shared machine) do not enter it."""
    messages = user(PROMPTS[0])
    api, dense = open_client(target.url), replace(target, extra_body={"specee": MODES["dense"]})
    engine.generate(messages, max_tokens=4, **MODES["dense"])  # warm-up, untimed
    served, engine_s, local, decode = [], [], [], []
    for _ in range(OVERHEAD_RUNS):
        time.sleep(IDLE_GAP_S)
        start = time.perf_counter()
        reply = stream_chat(api, dense, messages, max_tokens)
        served.append(time.perf_counter() - start)
        engine_s.append(reply.engine_s)
        time.sleep(IDLE_GAP_S)
        start = time.perf_counter()
        result = engine.generate(messages, max_tokens=max_tokens, **MODES["dense"])
        local.append(time.perf_counter() - start)
        decode.append(result.stats.decode_s)
    return overhead_summary(served, engine_s, local, decode)


def overhead_summary(served: list[float], engine: list[float], local: list[float], decode: list[float]) -> dict:
    """`served[i]` took `engine[i]` of the server's own prefill and decode; `local`, the same request
    in this process, of which `decode` decoding."""
    extra = median(s - e for s, e in zip(served, engine))
    return {"server_s": median(served), "server_engine_s": median(engine), "in_process_s": median(local),
            "decode_s": median(decode), "overhead_s": extra, "overhead_of_decode": extra / median(decode)}


def bench_specee(engine: Engine, config: ServeBenchConfig,
                 server_flags: list[str]) -> tuple[list[LoadSummary], dict, list[str]]:
    """Every specee mode at every concurrency, then its overhead on one request, and notes. Each run
    has a server of its own, so that no run's caches (the prompts' prefixes, the answers `auto`
    drafts from) serve another and every mode answers the same prompts; the runs of a server at
    --url share its caches, so their prompts are tagged apart."""
    flags = [*server_flags, "--threads", str(config.threads), "--max-queue", str(max(config.concurrency) * 2)]
    flags += ["--max-batch", str(config.max_batch)] if config.max_batch else []
    name = "specee serve" + (f" --max-batch {config.max_batch}" if config.max_batch else "")
    modes = [mode for mode in config.modes if mode in MODES]
    best: dict[tuple[str, int], LoadSummary] = {}
    speeds: dict[tuple[str, int], list[float]] = {}  # every round's tokens/s
    # The modes interleave: each concurrency runs every mode in turn (rotated from one concurrency
    # and round to the next), and a mode keeps its fastest round.
    for turn, (_, clients) in enumerate((r, c) for r in range(config.rounds) for c in config.concurrency):
        for mode in rotated(modes, turn):
            with specee_server(config, flags, name) as base:
                tag = f"[run {next(_run_tags)}]" if config.url else None
                run = run_load(replace(base, system=f"specee {mode}", extra_body={"specee": MODES[mode]}), clients,
                               config, tag)
            speeds.setdefault((mode, clients), []).append(run.tokens_per_s)
            if (mode, clients) not in best or run.tokens_per_s > best[mode, clients].tokens_per_s:
                best[mode, clients] = run
    summaries = [best[mode, clients] for mode in modes for clients in config.concurrency]
    with specee_server(config, flags, name) as base:
        overhead = measure_overhead(base, engine, config.max_tokens)
    if len(modes) == 1:
        return summaries, overhead, []
    notes = [answers_note(summaries, shared=config.url is not None)]
    if config.rounds > 1:
        notes.append(paired_note(speeds, modes, config.concurrency))
    return summaries, overhead, notes


def paired_note(speeds: dict[tuple[str, int], list[float]], modes: list[str], concurrency: list[int]) -> str:
    """Each mode against the first, round by round: the geometric mean of the rounds' ratios of
    tokens/s and their range. A round runs the modes back to back, so the machine's drift between
    rounds (a run's speed moves by 20% or more on a shared VM) falls on both sides of each ratio;
    the table's fastest rounds are each mode's luckiest run."""
    base, parts = modes[0], []
    rounds = len(speeds[base, concurrency[0]])
    for mode in modes[1:]:
        for clients in concurrency:
            ratios = [m / b if b else 0.0 for m, b in zip(speeds[mode, clients], speeds[base, clients])]
            mean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if min(ratios) > 0 else 0.0  # a run gave nothing
            parts.append(f"{mode} / {base} {mean:.3f}x at {clients} clients ({min(ratios):.2f}-{max(ratios):.2f})")
    return f"paired rounds (geometric mean of {rounds} rounds' ratios, range): " + "; ".join(parts)


@contextmanager
def specee_server(config: ServeBenchConfig, flags: list[str], name: str):
    """A warmed-up target: a `specee serve` started for it and stopped after, or the one at --url.
    The warm-up decodes dense: a drafting mode would leave drafts in the server's counters that no
    run asked for."""
    server = None if config.url else ServerProcess(*flags)
    try:
        yield warm_up(Target("specee", name if server else f"specee serve at {config.url}",
                             config.url or server.url, extra_body={"specee": MODES["dense"]},
                             pid=server.pid if server else None))
    finally:
        if server is not None:
            server.stop()


def answers_note(summaries: list[LoadSummary], shared: bool) -> str:
    """Whether specee's modes gave the same answers (greedy, the same prompts) at each concurrency."""
    if shared:
        return ("answers not compared: the modes shared the server at --url, so each run's prompts were tagged "
                "apart, and a run's drafters could copy an earlier run's answers")
    differ = [clients for clients in dict.fromkeys(s.clients for s in summaries)
              if len({s.answers for s in summaries if s.clients == clients}) > 1]
    if not differ:
        return "answers: every mode gave the same answers at every concurrency (greedy, the same prompts)"
    return f"answers DIFFER between the modes at {', '.join(map(str, differ))} clients (greedy, the same prompts)"


def bench_llama_cpp(config: ServeBenchConfig) -> tuple[list[LoadSummary], str]:
    """llama.cpp at every concurrency, and which server ran (or why none did)."""
    if config.gguf is None:
        return [], "llama.cpp skipped: it needs a GGUF file and --model is not one"
    choice = llama_cpp_server.choose_server(config.llama_server)
    if choice.server is None:
        return [], f"llama.cpp skipped: {choice.reason}"
    try:
        server, name = llama_cpp_server.start_server(choice, config.gguf, config.threads, config.slots,
                                                     config.max_tokens, PROMPT_ROOM[config.scenario])
    except RuntimeError as e:  # specee's rows are kept; the server's last words say why
        return [], f"llama.cpp skipped: {choice.server} did not start: " + " | ".join(str(e).splitlines()[-3:])
    try:
        # llama-server keeps each slot's prefix (`cache_prompt`, its default) for the next request.
        cache = {"cache_prompt": True} if choice.server == llama_cpp_server.LLAMA_SERVER else None
        target = warm_up(Target(LLAMA_CPP, name, server.url, extra_body=cache, pid=server.pid))
        # One server for every run: each run's conversations are tagged apart, as on a shared specee server.
        return ([run_load(target, clients, config, f"[run {next(_run_tags)}]") for clients in config.concurrency],
                f"llama.cpp: {choice.reason}")
    finally:
        server.stop()


def format_table(summaries: list[LoadSummary], overhead: dict | None, notes: list[str] = ()) -> str:
    turns = any(not math.isnan(s.late_ttft_p50_s) for s in summaries)
    late = f" {'turn4+ p50':>10} {'turn4+ p95':>10} {'prompt':>6} {'cached':>6}" if turns else ""
    repeats = any(not math.isnan(s.seen_tokens_per_s) for s in summaries)
    split = f" {'seen tok/s':>10} {'new tok/s':>9}" if repeats else ""
    lines = [f"{'system/mode':<26} {'clients':>7} {'requests':>8} {'req/s':>7} {'tok/s':>8} {'tok/s/client':>12} "
             f"{'TTFT p50':>9} {'TTFT p95':>9}{late}{split} {'peak MB':>8}  server"]
    for s in summaries:
        peak = f"{s.peak_rss_mb:>8.0f}" if s.peak_rss_mb is not None else f"{'-':>8}"
        cached = f"{s.cached_share:>6.0%}" if s.cached_share is not None else f"{'-':>6}"
        late = (f" {s.late_ttft_p50_s:>9.3f}s {s.late_ttft_p95_s:>9.3f}s {s.prompt_tokens_mean:>6.0f} {cached}"
                if turns else "")
        split = f" {s.seen_tokens_per_s:>10.1f} {s.unseen_tokens_per_s:>9.1f}" if repeats else ""
        lines.append(f"{s.system:<26} {s.clients:>7} {s.requests:>8} {s.requests_per_s:>7.2f} {s.tokens_per_s:>8.1f} "
                     f"{s.tokens_per_s_per_client:>12.1f} {s.ttft_p50_s:>8.3f}s {s.ttft_p95_s:>8.3f}s{late}{split} "
                     f"{peak}  {s.server}")
    if repeats:
        lines.append("seen tok/s: completion tokens over the requests' own time, for the calls of conversations "
                     "whose task an earlier one sent; new tok/s: the others")
    lines += list(notes)
    if overhead:
        lines.append(f"specee server overhead on one request: {overhead['server_s']:.3f} s served, of which the "
                     f"server's prefill and decode {overhead['server_engine_s']:.3f} s = {overhead['overhead_s'] * 1000:+.1f} ms, "
                     f"{overhead['overhead_of_decode']:+.1%} of the {overhead['decode_s']:.3f} s decode (target < 5%); "
                     f"the same request in this process {overhead['in_process_s']:.3f} s (the server's engine "
                     f"{overhead['server_engine_s'] / overhead['in_process_s'] - 1:+.1%}: it shares the cores with the HTTP "
                     "loop and this client, and two processes' speeds drift apart)")
    return "\n".join(lines)


def plot_throughput(summaries: list[LoadSummary], path: Path):
    """Aggregate tokens/s against clients, one line per system/mode; the figure, also saved to `path`."""
    from matplotlib.figure import Figure  # the object API leaves pyplot's global state alone

    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for system in dict.fromkeys(s.system for s in summaries):
        points = sorted((s.clients, s.tokens_per_s) for s in summaries if s.system == system)
        ax.plot(*zip(*points), marker="o", label=system)
    ax.set_xscale("log", base=2)
    clients = sorted({s.clients for s in summaries})
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def run_serve_bench(engine: Engine, config: ServeBenchConfig, server_flags: list[str]) -> dict:
    """One server at a time, so that none competes with another for the cores."""
    summaries, overhead, notes = [], None, []
    if any(mode in MODES for mode in config.modes):
        summaries, overhead, notes = bench_specee(engine, config, server_flags)
    if LLAMA_CPP in config.modes:
        rows, note = bench_llama_cpp(config)
        summaries += rows
        notes.append(note)
    print(format_table(summaries, overhead, notes))
    report = {"config": {**asdict(config), "out": str(config.out), "prompts": len(PROMPTS),
                         "conversations": config.conversation_count if config.scenario != "requests" else None,
                         "gguf": str(config.gguf) if config.gguf else None,
                         "llama_server": str(config.llama_server) if config.llama_server else None},
              "machine": machine_info(), "load": [asdict(s) for s in summaries], "notes": notes, "overhead": overhead}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2))
    if summaries and importlib.util.find_spec("matplotlib") is not None:
        plot = config.out.with_suffix(".png")
        plot_throughput(summaries, plot)
        print(f"plot: {plot}")
    print(json.dumps(report))
    return report
