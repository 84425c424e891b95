"""Log-probabilities a request asks for: each token's under the model, from the row of the pass
that chose it (a speculative pass's accepted rows included), with the likeliest alternatives."""
import math

import pytest
import torch

from helpers import tiny_model
from specee.engine import Engine
from specee.strategies.dense import Autoregressive

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    model = tiny_model(seed=11, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=3)
    return Engine(model, tiny_tokenizer)


def test_each_token_has_its_logprob_and_the_top_alternatives(engine):
    result = engine.generate(PROMPT, max_tokens=12, ignore_eos=True, logprobs=4)
    assert [t.token for t in result.logprobs] == result.token_ids
    ids = engine.encode(PROMPT) + result.token_ids
    with torch.inference_mode():
        logits = engine.model(torch.tensor(ids), torch.arange(len(ids)), engine.model.new_cache(len(ids)))
    expected = torch.log_softmax(logits[len(ids) - 13:-1].float(), -1)  # the rows that chose each token
    for row, entry in zip(expected, result.logprobs):
        assert entry.logprob == pytest.approx(row[entry.token].item(), abs=1e-4)
        assert [token for token, _ in entry.top] == row.topk(4).indices.tolist()
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy took the likeliest
        assert all(a >= b for (_, a), (_, b) in zip(entry.top, entry.top[1:]))
    assert engine.generate(PROMPT, max_tokens=3, logprobs=0).logprobs[0].top == []
    assert engine.generate(PROMPT, max_tokens=3).logprobs is None


@pytest.mark.parametrize("options", [dict(spec_method="draft", draft_model="self:2", num_draft_tokens=3),
                                     dict(spec_method="draft", draft_model="self:3", tree="0;1;0,0;0,1;1,0")])
def test_speculative_passes_report_the_rows_that_chose_each_token(engine, options):
    dense = engine.generate(PROMPT, max_tokens=16, ignore_eos=True, logprobs=2, spec_method="none")
    speculative = engine.generate(PROMPT, max_tokens=16, ignore_eos=True, logprobs=2, **options)
    assert speculative.token_ids == dense.token_ids and speculative.stats.draft_tokens_accepted > 0
    for a, b in zip(speculative.logprobs, dense.logprobs):
        assert a.token == b.token and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_streamed_logprobs_add_up_to_the_result_and_a_stop_string_cuts_them(engine):
    stream = engine.stream(PROMPT, max_tokens=20, ignore_eos=True, logprobs=1, spec_method="prompt-lookup")
    streamed = [entry for event in stream for entry in event.logprobs]
    assert streamed == stream.result.logprobs and len(streamed) == stream.result.completion_tokens
    text = stream.result.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = engine.generate(PROMPT, max_tokens=20, ignore_eos=True, logprobs=1, stop=stop, spec_method="prompt-lookup")
    assert cut.finish_reason == "stop" and len(cut.logprobs) == cut.completion_tokens < 20


def test_what_cannot_report_them_refuses(engine):
    with pytest.raises(ValueError, match="0..20"):
        engine.generate(PROMPT, max_tokens=2, logprobs=21)

    class ExitLike(Autoregressive):  # early exits choose among candidates at a partial depth
        name, full_logits = "exit", False

    with pytest.raises(ValueError, match="log-probabilities"):
        engine.generate(PROMPT, max_tokens=2, logprobs=1, strategy=ExitLike())
    with pytest.raises(ValueError, match="penalties"):
        engine.generate(PROMPT, max_tokens=2, presence_penalty=0.5, strategy=ExitLike())
    assert engine.generate(PROMPT, max_tokens=2, strategy=ExitLike()).completion_tokens == 2
