"""`/metrics` counts auto's choices per drafter (passes, second branches, draft tokens sent, draft tokens accepted)
and the suffix cache's state, in process over a tiny random model: a request repeated through the
server drafts from the first one's answer, and one naming a draft model drafts from it."""
import pytest
from fastapi.testclient import TestClient
from helpers import tiny_model
from prometheus_client.parser import text_string_to_metric_families

from specee.drafters.model_offer import ModelOffer
from specee.drafters.ngram import NgramModel
from specee.drafters.row_price import RowPrice
from specee.engine import Engine
from specee.server.app import ServerConfig, create_app
from specee.server.completions import Defaults

CHAT = {"messages": [{"role": "user", "content": "Call the weather tool for Paris."}], "max_tokens": 32}


@pytest.fixture(scope="module")
def client(tiny_tokenizer):
    engine = Engine(tiny_model(seed=11, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer)
    with TestClient(create_app(engine, ServerConfig("tiny", Defaults({})))) as client:
        yield client


def samples(client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def per_drafter(metrics: dict, name: str) -> dict[str, float]:
    return {dict(labels)["drafter"]: value for (sample, labels), value in metrics.items()
            if sample == f"specee_auto_drafter_{name}_total"}


def test_a_repeated_request_drafts_from_the_suffix_cache_and_the_metrics_count_each_drafter(client):
    answers = [client.post("/v1/chat/completions", json=CHAT).json() for _ in range(2)]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    metrics = samples(client)
    passes, drafted, accepted = (per_drafter(metrics, name) for name in ("passes", "drafted_tokens", "accepted_tokens"))
    method_passes = {}
    for answer in answers:
        for method, count in answer["specee"]["stats"]["method_passes"].items():
            method_passes[method] = method_passes.get(method, 0) + count
    assert passes == method_passes  # every pass of auto, by the drafter it chose
    assert passes["suffix"] > 0 and accepted["suffix"] >= 24  # the second answer, copied from the first
    assert all(accepted[d] <= drafted[d] for d in drafted) and drafted.get("none", 0) == 0
    assert metrics["specee_suffix_cache_documents_total", ()] == 2
    assert metrics["specee_suffix_cache_tokens", ()] > 2 * 32


def test_second_branches_are_counted_per_drafter(tiny_tokenizer, tmp_path):
    """Where rows are cheap (the tiny fp32 model's) and the server's table, trained on another
    text, guesses other tokens than the copy, the table's chains go out beside the copies:
    /metrics counts those passes per drafter, apart from the passes whose chain it drafted."""
    table = tmp_path / "table.pt"
    text = "the red fox ran. the cat sat on the mat. one two three four five six seven eight nine ten. " * 8
    NgramModel.train([tiny_tokenizer.encode(text)], tiny_tokenizer.vocab_size, progress=False).save(
        table, tiny_tokenizer.fingerprint)
    engine = Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer,
                    suffix_cache_tokens=0)
    with TestClient(create_app(engine, ServerConfig("tiny", Defaults({"ngram_model": str(table)})))) as client:
        for prompt in ("Repeat exactly: the red fox, the red fox, the red fox.", "the cat sat on the mat and looked."):
            request = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "ignore_eos": True}
            assert client.post("/v1/chat/completions", json=request).status_code == 200
        metrics = samples(client)
    branches, passes, drafted = (per_drafter(metrics, name) for name in ("branches", "passes", "drafted_tokens"))
    assert branches.get("ngram", 0) > 0 and set(branches) <= {"ngram", "prompt-lookup"}
    assert drafted["ngram"] >= branches["ngram"] + passes.get("ngram", 0)  # each pass drafted one token or more
    assert all(n > 0 for n in passes.values())  # a drafter seen only in branches has no passes sample


def test_a_request_naming_a_draft_model_drafts_from_it_and_the_metrics_say_so(client, monkeypatch):
    # Draft passes and rows at fixed prices (a draft pass at 0.02 of a target pass), so the tiny
    # model's first layer drafts where the free drafters offer nothing.
    monkeypatch.setattr(ModelOffer, "price", lambda self, one_row, measured: 0.02)
    monkeypatch.setattr(RowPrice, "record", lambda self, rows, seconds: None)
    before = per_drafter(samples(client), "passes").get("draft", 0)
    request = {"messages": [{"role": "user", "content": "Count from one to ten in words."}], "max_tokens": 40}
    drafted = client.post("/v1/chat/completions", json=request | {"specee": {"draft_model": "self:1"}}).json()
    dense = client.post("/v1/chat/completions", json=request | {"specee": {"spec_method": "none"}}).json()
    assert drafted["choices"][0]["message"] == dense["choices"][0]["message"]
    draft_passes = drafted["specee"]["stats"]["method_passes"].get("draft", 0)
    assert draft_passes > 0 and per_drafter(samples(client), "passes")["draft"] - before == draft_passes
    # Only the methods that read a draft model take one: anything else is a 4xx naming the option.
    refused = client.post("/v1/chat/completions", json=request | {"specee": {"spec_method": "prompt-lookup",
                                                                             "draft_model": "self:1"}})
    assert 400 <= refused.status_code < 500 and "draft_model" in refused.text
