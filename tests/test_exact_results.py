"""Every speculative method returns exactly what dense decoding returns for the same request,
when the request ends inside an accepted multi-token step: an EOS, the token limit or a stop
string falling inside the draft. Text, token ids, counts and finish reason must all match.

The token limit and the stop string are placed, per method, one token into a step that accepted
several tokens in that method's own unlimited run, so each cut lands inside a draft."""
import pytest

pytestmark = pytest.mark.slow

# The answer copies the prompt, whose chat-template end (<|im_end|>) follows the sentence: copy
# drafts run through the EOS.
PROMPT = "Repeat the following sentence exactly: The committee approved the budget for the new library on Tuesday."
# The n-gram table guesses none of that sentence's words after one another; it does guess code.
CODE_PROMPT = "Write a Python function that returns the square of a number."
PROMPT_OF = {"ngram chain": CODE_PROMPT, "ngram tree": CODE_PROMPT}
MAX_TOKENS = 48

METHODS = {
    "prompt-lookup chain": dict(spec_method="prompt-lookup"),
    "prompt-lookup static tree": dict(spec_method="prompt-lookup", tree="0;1;0,0;0,0,0;0,0,0,0"),
    "prompt-lookup dynamic tree": dict(spec_method="prompt-lookup", tree="auto", tree_budget=8),
    "ngram chain": dict(spec_method="ngram"),
    "ngram tree": dict(spec_method="ngram", tree="auto"),
    "hybrid chain": dict(spec_method="hybrid"),
    "hybrid tree": dict(spec_method="hybrid", tree="auto", tree_budget=8),
    "draft chain (all layers)": dict(spec_method="draft", draft_model="self:30", num_draft_tokens=6),
    "draft tree (all layers)": dict(spec_method="draft", draft_model="self:30", tree="auto", tree_budget=6),
    "staged (all layers + prompt lookup)": dict(spec_method="staged", draft_model="self:30", num_draft_tokens=6),
}


def summary(result):
    return result.text, result.token_ids, result.completion_tokens, result.finish_reason


def produced(result) -> int:
    """Tokens the strategy produced: the root token, then every verification pass's."""
    return 1 + sum(result.stats.accept_lengths)


def cut_points(result, tokenizer) -> tuple[int, str]:
    """(a token limit one token into the first multi-token step, a stop string that is first
    completed by that same token)."""
    end = 1
    for gained in result.stats.accept_lengths:
        if gained >= 2 and end + 2 <= len(result.token_ids):
            cut = end + 1
            break
        end += gained
    else:
        pytest.fail("no verification pass accepted a draft token")
    before = tokenizer.decode(result.token_ids[: cut - 1])
    upto = tokenizer.decode(result.token_ids[:cut])
    assert upto.startswith(before) and len(upto) > len(before)
    for length in range(len(upto) - len(before), len(upto) + 1):  # the shortest suffix seen first here
        stop = upto[-length:]
        if result.text.find(stop) == len(upto) - length:
            return cut, stop
    pytest.fail("no unique stop string")


@pytest.fixture(scope="module")
def dense_of(default_engine):
    cache = {}

    def run(prompt, **request):
        key = prompt + repr(sorted(request.items()))
        if key not in cache:
            cache[key] = default_engine.generate(prompt, spec_method="none", **request)
        return cache[key]

    return run


@pytest.mark.parametrize("method", METHODS)
def test_requests_ending_inside_a_draft_match_dense(default_engine, dense_of, method):
    options, prompt = METHODS[method], PROMPT_OF.get(method, PROMPT)
    full = default_engine.generate(prompt, max_tokens=MAX_TOKENS, **options)
    assert full.finish_reason == "stop"  # EOS before the limit
    assert summary(full) == summary(dense_of(prompt, max_tokens=MAX_TOKENS))
    cut, stop = cut_points(full, default_engine.tokenizer)
    for request in (dict(max_tokens=cut), dict(max_tokens=MAX_TOKENS, stop=[stop])):
        result = default_engine.generate(prompt, **request, **options)
        assert summary(result) == summary(dense_of(prompt, **request)), f"{method}, {request}"
        assert result.stats.generated_tokens == len(result.token_ids) == cut
        assert produced(result) > cut  # the step went on past the cut
    if options["spec_method"] == "prompt-lookup":
        assert produced(full) > len(full.token_ids)  # the EOS itself came inside a copied draft
