"""`specee bench-serve`'s arithmetic, bookkeeping and the servers it starts (no timings are
asserted, none measured; no model, no server, no llama.cpp is needed)."""
import math
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import specee.model.loading as loading
from specee import cli
from specee.cli import main
from specee.eval import llama_cpp_server, serve_bench, serve_scenarios
from specee.eval.llama_cpp_server import (LLAMA_SERVER, PYTHON_SERVER, choose_server, llama_server_command, model_gguf,
                                          python_server_command)
from specee.eval.serve_bench import (RequestRecord, ServeBenchConfig, Target, format_table, overhead_summary,
                                     percentile, plot_throughput, run_load, stream_chat, summarize_load)
from specee.eval.server_process import peak_rss_mb, process_peak_rss_mb, reset_peak_rss

TARGET = Target("specee dense", "specee serve", "http://127.0.0.1:9")


def test_nearest_rank_percentiles():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == 5.0
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 95) == 7.0
    assert percentile(list(range(1, 101)), 95) == 95


def test_load_summary_arithmetic():
    records = [  # client 0: 30 tokens over 0..3 s; client 1: 10 tokens over 1..2 s
        RequestRecord(0, start_s=0.0, first_token_s=0.5, end_s=1.0, completion_tokens=10),
        RequestRecord(0, start_s=1.0, first_token_s=0.25, end_s=3.0, completion_tokens=20),
        RequestRecord(1, start_s=1.0, first_token_s=1.0, end_s=2.0, completion_tokens=10),
    ]
    s = summarize_load(TARGET, 2, records, wall_s=4.0, peak_rss_mb=321.0)
    assert (s.requests, s.requests_per_s) == (3, 0.75)
    assert (s.completion_tokens, s.tokens_per_s) == (40, 10.0)  # every client's tokens over the wall time
    assert s.tokens_per_s_per_client == pytest.approx((30 / 3 + 10 / 1) / 2)
    assert (s.ttft_p50_s, s.ttft_p95_s) == (0.5, 1.0)
    assert (s.system, s.server, s.peak_rss_mb) == ("specee dense", "specee serve", 321.0)
    assert math.isnan(summarize_load(TARGET, 1, [RequestRecord(0, 0, None, 1, 0)], 1).ttft_p50_s)


def test_overhead_is_each_served_requests_time_less_the_servers_own_over_the_decode_time():
    # The in-process runs are slower than the server's own work here (the processes' speeds drift
    # apart): the overhead is read within each served request, not against them.
    o = overhead_summary(served=[1.10, 1.00, 1.30], engine=[1.05, 0.98, 1.20], local=[1.20, 1.25, 1.30],
                         decode=[0.8, 0.9, 1.0])
    assert o["overhead_s"] == pytest.approx(0.05)  # the median of 0.05, 0.02 and 0.10
    assert (o["server_s"], o["server_engine_s"], o["in_process_s"]) == (1.10, 1.05, 1.25)
    assert o["overhead_of_decode"] == pytest.approx(0.05 / 0.9)
    assert "of which the server's prefill and decode 1.050 s = +50.0 ms, +5.6% of the 0.900 s decode" in format_table([], o)


def test_the_table_says_which_server_ran_and_what_was_skipped():
    rows = [summarize_load(Target("llama.cpp", "llama-server -np 16", "u"), 2, [RequestRecord(0, 0, 0.1, 1, 8)], 1.0),
            summarize_load(TARGET, 2, [RequestRecord(0, 0, 0.1, 1, 8)], 1.0, peak_rss_mb=512.4)]
    lines = format_table(rows, None, ["llama.cpp: /x/llama-server"]).splitlines()
    assert lines[1].startswith("llama.cpp") and lines[1].endswith("llama-server -np 16")
    assert " - " in lines[1] and " 512 " in lines[2]  # no peak measured for the first row
    assert lines[-1] == "llama.cpp: /x/llama-server" and "overhead" not in "\n".join(lines)


class FakeStream:
    """Chunks as the openai client yields them; each one advances serve_bench's clock by a second."""

    def __init__(self, monkeypatch, contents, usage, stats=None):
        self.clock = [0.0]
        monkeypatch.setattr(serve_bench.time, "perf_counter", lambda: self.clock[0])
        self.chunks = [SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=c))], usage=None)
                       for c in contents]
        if usage is not None:
            self.chunks.append(SimpleNamespace(choices=[], usage=SimpleNamespace(
                completion_tokens=usage, prompt_tokens=40, prompt_tokens_details=SimpleNamespace(cached_tokens=32)),
                model_extra={"specee": {"stats": stats}} if stats else {}))
        self.requests = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **request):
        self.requests.append(request)
        for chunk in self.chunks:
            self.clock[0] += 1
            yield chunk


def test_ttft_is_the_first_chunk_with_content_and_tokens_come_from_usage(monkeypatch):
    client = FakeStream(monkeypatch, [None, "Hi", "", " there"], usage=7,  # a role-only chunk first
                        stats={"prefill_s": 0.25, "decode_s": 1.5, "target_passes": 6})
    target = Target("specee hybrid-tree", "s", "u", model="m", extra_body={"specee": {"spec_method": "hybrid"}})
    messages = [{"role": "user", "content": "p"}]
    assert stream_chat(client, target, messages, 5) == (2.0, 7, "Hi there", 40, 32, 1.75)  # the server's own seconds
    assert stream_chat(FakeStream(monkeypatch, ["Hi"], usage=1), target, messages, 5).engine_s is None  # not a specee server
    request = client.requests[0]
    assert request["stream"] and request["stream_options"] == {"include_usage": True}
    assert (request["extra_body"], request["model"], request["max_tokens"]) == (target.extra_body, "m", 5)
    assert request["messages"] == messages
    assert request["temperature"] == 0  # greedy on every server: the same work for each


def test_without_a_usage_chunk_the_content_chunks_are_counted(monkeypatch):
    reply = stream_chat(FakeStream(monkeypatch, ["a", "b", "c"], usage=None), TARGET, serve_bench.user("p"), 5)
    assert reply == (1.0, 3, "abc", None, None, None)


def test_every_client_sends_its_requests_in_order_and_peak_memory_is_read_around_them(monkeypatch):
    events = []

    def fake_stream(client, target, messages, max_tokens):
        [message] = messages
        events.append(("request", message["content"], max_tokens, target.extra_body["specee"]["spec_method"]))
        return serve_bench.Reply(0.01, 7, "answer")

    monkeypatch.setattr(serve_bench, "stream_chat", fake_stream)
    monkeypatch.setattr(serve_bench, "reset_peak_rss", lambda pid: events.append(("reset", pid)))
    monkeypatch.setattr(serve_bench, "process_peak_rss_mb", lambda pid: events.append(("read", pid)) or 99.0)
    target = Target("specee hybrid-tree", "specee serve", "http://127.0.0.1:9",
                    extra_body={"specee": serve_bench.MODES["hybrid-tree"]}, pid=1234)
    summary = run_load(target, 3, ServeBenchConfig(requests_per_client=2, max_tokens=5))
    assert (summary.requests, summary.clients, summary.system, summary.completion_tokens) == (6, 3, "specee hybrid-tree", 42)
    assert events[0] == ("reset", 1234) and events[-1] == ("read", 1234) and summary.peak_rss_mb == 99.0
    sent = events[1:-1]
    assert {s[2:] for s in sent} == {(5, "hybrid")}
    assert {s[1] for s in sent} == set(serve_bench.PROMPTS[:4])  # clients start at different prompts
    assert summary.ttft_p95_s == 0.01


def test_peak_memory_is_read_from_vmhwm_in_mib():
    status = "Name:\tllama-server\nVmPeak:\t 9999999 kB\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n"
    assert peak_rss_mb(status) == 200.0
    assert peak_rss_mb("Name:\tkthreadd\nState:\tS (sleeping)\n") is None  # kernel threads have no Vm lines
    assert process_peak_rss_mb(2**22 + 12345) is None  # beyond any pid: no such process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_resetting_the_peak_forgets_memory_already_freed():
    """Each row's peak is the server's own over that row, not the largest since it started."""
    pid = os.getpid()
    block = bytearray(256 * 2**20)  # zero-filled, so resident
    del block
    before = process_peak_rss_mb(pid)
    if not reset_peak_rss(pid):
        pytest.skip("clear_refs is not writable here")
    after = process_peak_rss_mb(pid)
    assert after < before - 200, (before, after)


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_is_chosen_where_the_binary_is(tmp_path, monkeypatch):
    binary = executable(tmp_path / "llama-server")
    choice = choose_server(binary, importable=lambda name: False)
    assert (choice.server, choice.binary) == (LLAMA_SERVER, binary)
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))  # the build script's place is the default
    installed = executable((tmp_path / "cache/llama-server/bin").mkdir(parents=True) or
                           tmp_path / "cache/llama-server/bin/llama-server")
    assert choose_server(None, importable=lambda name: False).binary == installed


def test_without_llama_server_llama_cpp_python_serves_else_nothing(tmp_path):
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    fallback = choose_server(not_executable, importable=lambda name: True)
    assert (fallback.server, fallback.binary) == (PYTHON_SERVER, None) and "does not batch" in fallback.reason
    skipped = choose_server(tmp_path / "missing", importable=lambda name: name != "sse_starlette")
    assert skipped.server is None
    assert "build_llama_server.sh" in skipped.reason and "sse_starlette" in skipped.reason


def flags(command: list[str]) -> dict[str, str]:
    """Each --name of a command line with the word after it."""
    return {word: after for word, after in zip(command, command[1:]) if word.startswith("--")}


def test_llama_server_gets_the_same_gguf_threads_and_a_slot_per_client(tmp_path):
    gguf = tmp_path / "model.gguf"
    command = llama_server_command(tmp_path / "llama-server", gguf, 8123, threads=3, parallel=16, context=300)
    assert command[0] == str(tmp_path / "llama-server")
    options = flags(command)
    assert (options["--model"], options["--threads"], options["--parallel"]) == (str(gguf), "3", "16")
    assert (options["--host"], options["--port"]) == ("127.0.0.1", "8123")
    assert int(options["--ctx-size"]) == 16 * 300  # -c is shared by the slots


def test_llama_cpp_python_gets_the_same_gguf_threads_and_queues_requests(tmp_path):
    gguf = tmp_path / "model.gguf"
    command = python_server_command(gguf, 8123, threads=3, context=300)
    assert command[:3] == [sys.executable, "-m", "llama_cpp.server"]
    options = flags(command)
    assert (options["--model"], options["--n_threads"], options["--n_threads_batch"]) == (str(gguf), "3", "3")
    assert options["--interrupt_requests"] == "False"  # its default cuts a streaming answer at the next request
    assert options["--n_ctx"] == "300"


def test_the_gguf_is_the_model_file_or_the_default_models(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_gguf(str(gguf)) == gguf
    assert model_gguf(str(tmp_path)) is None  # a Hugging Face directory: llama.cpp cannot read it
    monkeypatch.setattr(loading, "default_model_path", lambda: gguf)
    assert model_gguf(None) == gguf


class FakeServer:
    def __init__(self, *flags, **kwargs):
        self.flags, self.url, self.pid, self.stopped = list(flags), "http://127.0.0.1:9", 4321, False
        FakeServer.last = self

    def stop(self):
        self.stopped = True
        return 0


@pytest.fixture
def no_requests(monkeypatch):
    """run_load and the warm-up record their targets instead of sending anything."""
    targets = []
    monkeypatch.setattr(serve_bench, "warm_up", lambda target: target)
    monkeypatch.setattr(serve_bench, "run_load", lambda target, clients, config, tag=None: targets.append((target, clients))
                        or summarize_load(target, clients, [RequestRecord(0, 0, 0.1, 1, 8)], 1.0))
    monkeypatch.setattr(serve_bench, "measure_overhead", lambda target, engine, max_tokens: {})
    return targets


@pytest.mark.parametrize("max_batch", [None, 4])
def test_specee_serve_gets_the_threads_and_max_batch_only_when_given(monkeypatch, no_requests, max_batch):
    monkeypatch.setattr(serve_bench, "ServerProcess", FakeServer)
    config = ServeBenchConfig(concurrency=[1, 2], modes=["dense", "hybrid-tree", "llama.cpp"], threads=3,
                              max_batch=max_batch)
    serve_bench.bench_specee(None, config, ["--quantization=gguf"])
    options = flags(FakeServer.last.flags)
    assert options["--threads"] == "3" and "--quantization=gguf" in FakeServer.last.flags
    assert options.get("--max-batch") == (str(max_batch) if max_batch else None)
    assert FakeServer.last.stopped
    # Modes interleave at each concurrency, the first mode rotating.
    assert [(t.system, c) for t, c in no_requests] == [("specee dense", 1), ("specee hybrid-tree", 1),
                                                       ("specee hybrid-tree", 2), ("specee dense", 2)]
    assert {t.pid for t, _ in no_requests} == {4321}


def test_the_warm_up_decodes_dense_whatever_the_runs_mode(monkeypatch):
    """An untimed warm-up in the server's default mode (`auto`) would leave drafts in its counters
    that the dense runs of cluster_scaling.py never asked for."""
    warmed = []
    monkeypatch.setattr(serve_bench, "ServerProcess", FakeServer)
    monkeypatch.setattr(serve_bench, "warm_up", lambda target: warmed.append(target.extra_body) or target)
    monkeypatch.setattr(serve_bench, "run_load", lambda target, clients, config, tag=None: summarize_load(
        target, clients, [RequestRecord(0, 0, 0.1, 1, 8)], 1.0))
    monkeypatch.setattr(serve_bench, "measure_overhead", lambda target, engine, max_tokens: {})
    serve_bench.bench_specee(None, ServeBenchConfig(concurrency=[1], modes=["auto"], url="http://127.0.0.1:9"), [])
    assert warmed == [{"specee": {"spec_method": "none"}}] * 2  # the run's server and the overhead's


def test_each_mode_keeps_its_fastest_round(monkeypatch):
    monkeypatch.setattr(serve_bench, "ServerProcess", FakeServer)
    monkeypatch.setattr(serve_bench, "warm_up", lambda target: target)
    monkeypatch.setattr(serve_bench, "measure_overhead", lambda target, engine, max_tokens: {})
    speeds = iter([1.0, 2.0, 3.0, 4.0, 8.0, 0.5, 0.25, 9.0])  # (mode, clients) in the order they run
    ran = []

    def run_load(target, clients, config, tag=None):
        ran.append((target.system, clients))
        return summarize_load(target, clients, [RequestRecord(0, 0, 0.1, 1, 8)], 8 / next(speeds))

    monkeypatch.setattr(serve_bench, "run_load", run_load)
    config = ServeBenchConfig(concurrency=[1, 2], modes=["dense", "auto"], rounds=2)
    summaries, _, [_, paired] = serve_bench.bench_specee(None, config, [])
    assert len(ran) == 8 and len(set(ran)) == 4  # every mode at every concurrency, twice
    best = {}
    for (system, clients), speed in zip(ran, [1.0, 2.0, 3.0, 4.0, 8.0, 0.5, 0.25, 9.0]):
        best[system, clients] = max(best.get((system, clients), 0), speed)
    assert [(s.system, s.clients) for s in summaries] == [("specee dense", 1), ("specee dense", 2),
                                                           ("specee auto", 1), ("specee auto", 2)]
    assert [s.tokens_per_s for s in summaries] == pytest.approx([best[s.system, s.clients] for s in summaries])
    # Besides the fastest rounds, each round's ratio of auto to dense, round by round.
    rounds = {}
    for (system, clients), speed in zip(ran, [1.0, 2.0, 3.0, 4.0, 8.0, 0.5, 0.25, 9.0]):
        rounds.setdefault((system, clients), []).append(speed)
    ratios = {c: [a / d for a, d in zip(rounds["specee auto", c], rounds["specee dense", c])] for c in (1, 2)}
    assert ratios == {1: [2.0, 0.0625], 2: [0.75, 0.25 / 9]}  # the order rotates with each turn
    assert paired == ("paired rounds (geometric mean of 2 rounds' ratios, range): "
                      f"auto / dense {math.sqrt(0.125):.3f}x at 1 clients (0.06-2.00); "
                      f"auto / dense {math.sqrt(0.75 * 0.25 / 9):.3f}x at 2 clients (0.03-0.75)")
    # A round in which a mode served nothing (every request failed) reads 0, not a traceback.
    assert serve_bench.paired_note({("dense", 1): [2.0, 0.0], ("auto", 1): [1.0, 3.0]}, ["dense", "auto"], [1]) == (
        "paired rounds (geometric mean of 2 rounds' ratios, range): auto / dense 0.000x at 1 clients (0.00-0.50)")


class CountedServer(FakeServer):
    started = []

    def __init__(self, *flags, **kwargs):
        super().__init__(*flags, **kwargs)
        CountedServer.started.append(self)


@pytest.mark.parametrize("url", [None, "http://127.0.0.1:9"])
def test_every_run_has_a_server_of_its_own_and_the_modes_answers_are_compared(monkeypatch, url):
    """No run is served from another's caches: each run (and the overhead's request) gets a fresh
    server and the same untagged prompts, and a mode whose answers differ is named; runs on a
    server at --url share it, so their prompts are tagged apart and their answers not compared."""
    CountedServer.started = []
    monkeypatch.setattr(serve_bench, "ServerProcess", CountedServer)
    monkeypatch.setattr(serve_bench, "warm_up", lambda target: target)
    monkeypatch.setattr(serve_bench, "measure_overhead", lambda target, engine, max_tokens: {})
    tags, answers = [], iter(["a", "a", "a", "b"])  # (mode, clients) in the order they run

    def run_load(target, clients, config, tag=None):
        tags.append(tag)
        return summarize_load(target, clients, [RequestRecord(0, 0, 0.1, 1, 8, text=next(answers))], 1.0)

    monkeypatch.setattr(serve_bench, "run_load", run_load)
    config = ServeBenchConfig(concurrency=[1, 2], modes=["dense", "auto"], url=url)
    summaries, _, [note] = serve_bench.bench_specee(None, config, [])
    if url is None:
        assert len(CountedServer.started) == 5 and all(server.stopped for server in CountedServer.started)
        assert tags == [None] * 4
        assert note.startswith("answers DIFFER between the modes at 2 clients")
    else:
        assert CountedServer.started == [] and len(set(tags)) == 4 and None not in tags
        assert note.startswith("answers not compared")
    alike = [summarize_load(TARGET, 1, [RequestRecord(0, 0, 0.1, 1, 8, text="same")], 1.0) for _ in range(2)]
    assert serve_bench.answers_note(alike, shared=False).startswith("answers: every mode gave the same answers")


@pytest.mark.parametrize("parallel, slots", [(None, 8), (2, 2)])
def test_llama_cpp_gets_the_gguf_threads_and_slots(monkeypatch, no_requests, tmp_path, parallel, slots):
    started = []
    choice = llama_cpp_server.LlamaCppChoice(LLAMA_SERVER, tmp_path / "llama-server", "found")
    monkeypatch.setattr(llama_cpp_server, "choose_server", lambda binary: choice)
    monkeypatch.setattr(llama_cpp_server, "start_server", lambda *args: started.append(args)
                        or (FakeServer(), f"llama-server -np {args[3]}"))
    config = ServeBenchConfig(concurrency=[1, 8, 4], threads=3, parallel=parallel, gguf=tmp_path / "m.gguf")
    rows, note = serve_bench.bench_llama_cpp(config)
    assert started == [(choice, tmp_path / "m.gguf", 3, slots, config.max_tokens, 512)]
    assert [r.clients for r in rows] == [1, 8, 4] and {r.server for r in rows} == {f"llama-server -np {slots}"}
    assert FakeServer.last.stopped and "found" in note


def test_llama_cpp_is_skipped_with_the_reason(monkeypatch, no_requests, tmp_path):
    skipped = llama_cpp_server.LlamaCppChoice(None, None, "no llama-server anywhere")
    monkeypatch.setattr(llama_cpp_server, "choose_server", lambda binary: skipped)
    assert serve_bench.bench_llama_cpp(ServeBenchConfig(gguf=tmp_path / "m.gguf")) == (
        [], "llama.cpp skipped: no llama-server anywhere")
    rows, note = serve_bench.bench_llama_cpp(ServeBenchConfig(gguf=None))
    assert rows == [] and "GGUF" in note and no_requests == []


def test_a_llama_cpp_server_that_dies_at_startup_is_a_note_not_a_crash(monkeypatch, no_requests, tmp_path):
    def dies(*args):
        raise RuntimeError("the server exited with -11:\nloading model\nthreadpool init")

    monkeypatch.setattr(llama_cpp_server, "choose_server",
                        lambda binary: llama_cpp_server.LlamaCppChoice(LLAMA_SERVER, tmp_path / "x", "found"))
    monkeypatch.setattr(llama_cpp_server, "start_server", dies)
    rows, note = serve_bench.bench_llama_cpp(ServeBenchConfig(gguf=tmp_path / "m.gguf"))
    assert rows == [] and note.startswith("llama.cpp skipped: llama-server did not start") and "-11" in note


def test_the_plot_has_a_line_per_system(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [summarize_load(Target(system, "s", "u"), clients, [RequestRecord(0, 0, 0.1, 1, 8 * clients)], 1.0)
            for system in ("specee dense", "llama.cpp") for clients in (1, 2, 4)]
    ax = plot_throughput(rows, tmp_path / "bench.png").axes[0]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert [line.get_label() for line in ax.lines] == ["specee dense", "llama.cpp"]
    assert list(ax.lines[1].get_xdata()) == [1, 2, 4] and list(ax.lines[1].get_ydata()) == [8.0, 16.0, 32.0]
    assert ax.get_xscale() == "log"


def test_the_command_line_serves_the_default_models_gguf_with_the_threads(monkeypatch, tmp_path):
    gguf = tmp_path / "default.gguf"
    gguf.write_bytes(b"GGUF")
    seen = {}
    monkeypatch.setattr(loading, "default_model_path", lambda: gguf)
    monkeypatch.setattr(cli.loading, "load", lambda args: "engine")
    monkeypatch.setattr(serve_bench, "run_serve_bench", lambda engine, config, flags: seen.update(config=config, flags=flags))
    assert main(["bench-serve", "--threads", "3", "--max-batch", "4", "--quantization", "gguf"]) == 0
    config = seen["config"]
    assert (config.gguf, config.threads, config.max_batch, config.slots) == (gguf, 3, 4, 16)
    assert config.concurrency == [1, 2, 4, 8, 16] and "llama.cpp" in config.modes
    assert "--quantization=gguf" in seen["flags"] and not any("--model" in f for f in seen["flags"])


def test_an_output_folder_takes_the_report_and_an_unwritable_one_is_refused_first(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(loading, "default_model_path", lambda: tmp_path / "default.gguf")
    monkeypatch.setattr(cli.loading, "load", lambda args: seen.setdefault("loaded", True))
    monkeypatch.setattr(serve_bench, "run_serve_bench", lambda engine, config, flags: seen.update(out=config.out))
    assert main(["bench-serve", "--out", str(tmp_path)]) == 0
    assert seen["out"] == tmp_path / "bench-serve.json"
    assert main(["bench-serve", "--out", str(tmp_path / "new" / "run.json")]) == 0
    assert seen["out"] == tmp_path / "new" / "run.json"
    seen.clear()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench-serve", "--out", str(blocker / "run.json")]) == 2  # its folder is a file
    assert "cannot write" in capsys.readouterr().err and "loaded" not in seen


def test_bad_bench_serve_flags_exit_2(capsys, tmp_path):
    assert main(["bench-serve", "--modes", "dense,warp"]) == 2
    assert main(["bench-serve", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench-serve", "--llama-server", str(tmp_path / "missing")]) == 2
    assert "build_llama_server.sh" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["bench-serve", "--max-batch", "0"])
    assert exit.value.code == 2


def test_a_slot_holds_a_whole_conversation_and_llama_server_keeps_its_prefix(monkeypatch, no_requests, tmp_path):
    started = []
    choice = llama_cpp_server.LlamaCppChoice(LLAMA_SERVER, tmp_path / "llama-server", "found")
    monkeypatch.setattr(llama_cpp_server, "choose_server", lambda binary: choice)
    monkeypatch.setattr(llama_cpp_server, "start_server", lambda *args: started.append(args) or (FakeServer(), "s"))
    serve_bench.bench_llama_cpp(ServeBenchConfig(concurrency=[8], gguf=tmp_path / "m.gguf", scenario="agent",
                                                 max_tokens=100))
    assert started[0][4:] == (100, 3072)
    assert [t.extra_body for t, _ in no_requests] == [{"cache_prompt": True}]


def test_late_turns_and_the_cached_share_are_summarized_apart():
    records = [RequestRecord(0, 0, 0.9, 1, 5, turn=1, prompt_tokens=100, cached_tokens=0),
               RequestRecord(0, 1, 0.5, 2, 5, turn=3, prompt_tokens=200, cached_tokens=96),
               RequestRecord(0, 2, 0.2, 3, 5, turn=4, prompt_tokens=300, cached_tokens=288),
               RequestRecord(0, 3, 0.1, 4, 5, turn=5, prompt_tokens=400, cached_tokens=384)]
    s = summarize_load(TARGET, 1, records, 4.0)
    assert (s.late_ttft_p50_s, s.late_ttft_p95_s) == (0.1, 0.2)
    assert s.prompt_tokens_mean == 250 and s.cached_share == pytest.approx(768 / 1000)
    assert "turn4+ p50" in format_table([s], None) and " 77% " in format_table([s], None)
    plain = summarize_load(TARGET, 1, [RequestRecord(0, 0, 0.1, 1, 8)], 1.0)
    assert math.isnan(plain.late_ttft_p50_s) and plain.cached_share is None
    assert "turn4+" not in format_table([plain], None)


def scripted_server(monkeypatch):
    """stream_chat answering each request with a text naming its turn; the requests it saw."""
    seen = []

    def fake_stream(client, target, messages, max_tokens):
        seen.append([dict(m) for m in messages])
        turn = sum(m["role"] == "user" for m in messages)
        return serve_bench.Reply(0.01, 3, f"answer {turn}", prompt_tokens=10 * turn, cached_tokens=0)

    monkeypatch.setattr(serve_bench, "stream_chat", fake_stream)
    monkeypatch.setattr(serve_bench, "open_client", lambda url: None)
    return seen


def test_a_conversation_resends_its_history_with_the_servers_answers(monkeypatch):
    seen = scripted_server(monkeypatch)
    [script] = serve_scenarios.agent_scripts(1)
    summary = run_load(TARGET, 1, ServeBenchConfig(concurrency=[1], scenario="agent", conversations=1))
    assert summary.requests == len(script.turns) == serve_scenarios.AGENT_CALLS
    last = seen[-1]
    assert last[0]["role"] == "system" and last[0]["content"].endswith(script.opening[0]["content"])
    assert [m["content"] for m in last if m["role"] == "assistant"] == [f"answer {t}" for t in range(1, 5)]
    assert [m["content"] for m in last if m["role"] == "user"][1:] == list(script.turns[1:])
    for earlier, later in zip(seen, seen[1:]):  # each request begins with the whole one before it
        assert later[:len(earlier)] == earlier and len(later) == len(earlier) + 2


def test_conversations_are_dealt_round_the_clients_and_tagged_runs_share_no_prefix(monkeypatch):
    seen = scripted_server(monkeypatch)
    config = ServeBenchConfig(concurrency=[1, 3], scenario="agent", conversations=3)
    run_load(TARGET, 3, config)
    [first_run] = {m[0]["content"] for m in seen}  # the clients of one run share the system prompt...
    assert first_run == serve_scenarios.agent_system_prompt()  # (untagged: a server of its own)
    assert sorted({m[1]["content"] for m in seen}) == sorted(serve_scenarios.AGENT_TASKS[:3])
    seen.clear()
    run_load(TARGET, 1, config, "[run 8]")  # ...and one client runs every conversation of the next run, alone
    assert len(seen) == 3 * serve_scenarios.AGENT_CALLS
    [second_run] = {m[0]["content"] for m in seen}
    assert second_run == "[run 8] " + first_run  # tagged apart, so a shared server's caches serve neither from the other


def test_calls_of_a_task_sent_again_are_timed_apart(monkeypatch):
    tasks = len(serve_scenarios.AGENT_TASKS)
    scripts = serve_scenarios.agent_scripts(tasks + 2)
    assert [s.seen for s in scripts] == [False] * tasks + [True, True]
    assert scripts[tasks].turns[0] == scripts[0].turns[0] and scripts[tasks].turns[1:] != scripts[0].turns[1:]
    assert scripts[tasks].tagged("[run 1]").seen
    seen = scripted_server(monkeypatch)
    summary = run_load(TARGET, 1, ServeBenchConfig(concurrency=[1], scenario="agent", conversations=tasks + 1))
    assert len(seen) == (tasks + 1) * serve_scenarios.AGENT_CALLS
    assert summary.seen_tokens_per_s > 0 and summary.unseen_tokens_per_s > 0
    # Each request's rate is its tokens over its own time: 10 tokens in 1 s and 5 in 0.5 s seen, 30 in 2 s new.
    records = [RequestRecord(0, 0, 0.1, 1, 10, seen=True), RequestRecord(0, 1, 0.1, 1.5, 5, seen=True),
               RequestRecord(0, 2, 0.1, 4, 30)]
    split = summarize_load(TARGET, 1, records, 4.0)
    assert split.seen_tokens_per_s == pytest.approx(10.0) and split.unseen_tokens_per_s == pytest.approx(15.0)
    assert "seen tok/s" in format_table([split], None)
    plain = summarize_load(TARGET, 1, records[2:], 4.0)
    assert math.isnan(plain.seen_tokens_per_s) and "seen tok/s" not in format_table([plain], None)


def test_chat_conversations_chain_two_turn_questions_of_different_categories():
    questions = [serve_scenarios.Prompt(f"{c}{i}", c, [f"{c}{i} first", f"{c}{i} second"])
                 for c in ("math", "coding", "writing") for i in range(2)]
    scripts = serve_scenarios.chat_scripts(2, questions)
    assert scripts[0].turns == ("math0 first", "math0 second", "coding0 first", "coding0 second",
                                "writing0 first", "writing0 second")
    assert scripts[1].turns[0] == "math1 first" and scripts[0].opening == ()
    with pytest.raises(ValueError, match="need 9 questions"):
        serve_scenarios.chat_scripts(3, questions)
    tagged = scripts[0].tagged("[run 7]")
    assert tagged.turns[0] == "[run 7] math0 first" and tagged.turns[1:] == scripts[0].turns[1:]


def test_the_command_line_runs_a_scenario(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(loading, "default_model_path", lambda: tmp_path / "default.gguf")
    monkeypatch.setattr(cli.loading, "load", lambda args: "engine")
    monkeypatch.setattr(serve_bench, "run_serve_bench", lambda engine, config, flags: seen.update(config=config))
    assert main(["bench-serve", "--scenario", "chat", "--conversations", "4", "--concurrency", "1,8"]) == 0
    config = seen["config"]
    assert (config.scenario, config.conversations, config.conversation_count) == ("chat", 4, 4)
    assert ServeBenchConfig(concurrency=[1, 8]).conversation_count == 8
    choices = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["bench-serve"]._actions
                   if a.dest == "scenario").choices
    assert tuple(choices) == serve_scenarios.SCENARIOS
