"""Continuous batching end to end: a real `specee serve` process with the default model, driven by
the official `openai` client. Concurrent requests (mixed methods, lengths, a stop string, seeded
sampling, early exits, one cancelled mid-stream, one arriving while the others decode) share the server's
passes and each gets exactly the tokens it gets alone; a slot freed by a disconnect is reused."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_helpers import running_server
from test_server import delta, metrics

pytestmark = pytest.mark.slow  # real servers with the default model

# (prompt, options): every request differs in method, length or sampling.
REQUESTS = [
    ("Name three rivers in Europe.", dict(max_tokens=40)),
    ("Write a Python function that checks whether a string is a palindrome.",
     dict(max_tokens=64, extra_body={"specee": {"spec_method": "hybrid", "tree": "auto"}})),
    ("Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
     dict(max_tokens=48, extra_body={"specee": {"spec_method": "prompt-lookup"}})),
    ("What is 17 times 23? Explain the steps.", dict(max_tokens=24, extra_body={"specee": {"spec_method": "ngram"}})),
    ("Count from one to ten in words.", dict(max_tokens=60, stop=[" five"])),
    ("Give three tips for writing clear emails.",
     dict(max_tokens=32, temperature=0.8, seed=7, extra_body={"specee": {"spec_method": "hybrid", "tree": "auto"}})),
    ("Say yes.", dict(max_tokens=8)),
    ("Name a fruit and its colour.", dict(max_tokens=24, extra_body={"specee": {"exit": "specee"}})),
    # Cancelled after CANCEL_AFTER_CHUNKS chunks: dense, a token a chunk (under `auto` the suffix cache,
    # holding this answer from its run alone, can send all of it in three chunks).
    ("Translate to French: The weather is nice today and we are going to the beach.",
     dict(max_tokens=48, extra_body={"specee": {"spec_method": "none"}})),
]
LATE = ("Summarize in one sentence: the council approved the park's budget after a long debate.",
        dict(max_tokens=40, extra_body={"specee": {"spec_method": "prompt-lookup"}}))
CANCEL_AFTER_CHUNKS = 3


def stream(client, prompt: str, options: dict, stop_after: int | None = None,
           started: threading.Event | None = None) -> tuple[list[int], str | None]:
    """Streams one chat request; returns its token ids (from the `specee` field of each chunk) and
    its finish reason (None when this client closed the stream after `stop_after` chunks)."""
    ids, finish = [], None
    model = client.models.list().data[0].id
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                              stream=True, **options)
    with response:
        for count, chunk in enumerate(response, 1):
            ids += [token["id"] for token in (chunk.model_extra.get("specee") or {}).get("tokens", [])]
            if started is not None and len(ids) >= 4:
                started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if stop_after is not None and count >= stop_after:
                return ids, None
    return ids, finish


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def batching_server():
    server = running_server("--max-batch", "8", "--prefill-chunk", "32")
    yield server
    assert server.stop() == 0, server.output()


def test_concurrent_requests_each_get_the_tokens_they_get_alone(batching_server):
    client = openai_client(batching_server)
    requests = REQUESTS + [LATE]
    before_alone = metrics(batching_server)
    alone = [stream(client, prompt, options) for prompt, options in requests]
    before_together = metrics(batching_server)
    started = threading.Event()
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(stream, client, prompt, options, started=started if i == 0 else None)
                   for i, (prompt, options) in enumerate(requests[:-2])]
        futures.append(pool.submit(stream, client, *requests[-2], stop_after=CANCEL_AFTER_CHUNKS))
        assert started.wait(120)  # the late request arrives while the others decode
        futures.append(pool.submit(stream, client, *requests[-1]))
        together = [future.result() for future in futures]
    after = metrics(batching_server)
    for (ids, finish), (ids_alone, finish_alone), (prompt, _) in zip(together[:-2], alone[:-2], requests):
        assert (ids, finish) == (ids_alone, finish_alone), prompt
    assert together[-1] == alone[-1]  # the late joiner
    cancelled, _ = together[-2]
    assert 0 < len(cancelled) < len(alone[-2][0]) and cancelled == alone[-2][0][: len(cancelled)]
    assert alone[4][1] == "stop" and alone[0][1] == "length"  # the stop string ended one early
    # They shared passes: fewer than the same requests took one after another.
    passes_alone = delta(before_together, before_alone, "specee_shared_passes_total")
    passes_together = delta(after, before_together, "specee_shared_passes_total")
    assert passes_together < 0.6 * passes_alone
    assert delta(after, before_together, "specee_generations_total", outcome="cancelled") == 1
    assert httpx.get(batching_server.url + "/health").json() == {"status": "ok", "queued": 0, "running": 0}


def test_a_slot_freed_by_a_disconnect_is_reused():
    server = running_server("--max-batch", "1")
    try:
        client = openai_client(server)
        long = ("Write a long story about a dragon who learns to cook.", dict(max_tokens=400))
        short = ("Say yes.", dict(max_tokens=8))
        expected = stream(client, *short)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(stream, client, *long, stop_after=CANCEL_AFTER_CHUNKS + 20)
            deadline = time.monotonic() + 60
            while httpx.get(server.url + "/health").json()["running"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            second = pool.submit(stream, client, *short)  # waits: the one slot is taken
            while httpx.get(server.url + "/health").json()["queued"] == 0 and not second.done():
                time.sleep(0.01)
            ids, finish = first.result()
            assert finish is None and len(ids) < 400  # the first client left mid-stream
            assert second.result(timeout=60) == expected  # and the next request got its slot
        assert httpx.get(server.url + "/health").json() == {"status": "ok", "queued": 0, "running": 0}
    finally:
        assert server.stop() == 0, server.output()
