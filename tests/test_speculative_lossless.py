"""Greedy speculative decoding is lossless: on the default model (fp32), every proposer and every
verification shape (chain, static tree, dynamic tree) gives exactly plain greedy decoding's
tokens, including prompts where almost nothing is accepted and a draft equal to the target where
everything is."""
import pytest


pytestmark = pytest.mark.slow

PROMPTS = [
    # copying-heavy: drafts from the prompt are often right, whole chains and branches accepted
    "Repeat the following sentence exactly: The committee approved the budget for the new library on Tuesday.",
    "Add type hints to this function:\n```python\ndef area(width, height):\n    return width * height\n```",
    "Translate to French: I like apples. I like pears. I like apples and pears.",
    # little to copy: almost every draft is rejected
    "Write a haiku about winter.",
    "What is 17 times 23? Think step by step.",
    "Why is the sky blue?",
]
MAX_TOKENS = 96
SHORTER = 2 * MAX_TOKENS // 3  # the runs of methods other than `auto`, the default


@pytest.fixture(scope="module")
def dense(default_engine):
    """Dense decoding of every prompt, in one continuous batch: each row of a pass gives the bits of
    its one-row pass (test_batch_invariance.py), so these are plain greedy decoding's tokens, in a
    sixth of the time (test_the_batched_reference_is_plain_greedy_decoding checks one)."""
    from specee.batch import run_together

    generations = [default_engine.stream(p, max_tokens=MAX_TOKENS, ignore_eos=True, spec_method="none") for p in PROMPTS]
    return {p: result.token_ids for p, result in zip(PROMPTS, run_together(default_engine.model, generations))}


def test_the_batched_reference_is_plain_greedy_decoding(default_engine, dense):
    prompt = PROMPTS[3]
    alone = default_engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, spec_method="none")
    assert alone.token_ids == dense[prompt] and len(alone.token_ids) == MAX_TOKENS


@pytest.fixture(scope="module")
def ngram_table(default_engine, tmp_path_factory):
    """A small table from text unrelated to the prompts (the bundled one may not exist yet)."""
    from specee.drafters.ngram import NgramModel

    corpus = " ".join(["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1\n"] * 20)
    path = tmp_path_factory.mktemp("ngram") / "table.pt"
    NgramModel.train([default_engine.tokenizer.encode(corpus)], default_engine.tokenizer.vocab_size,
                     progress=False).save(path, default_engine.tokenizer.fingerprint)
    return str(path)


CONFIGS = {
    "prompt-lookup chain": dict(spec_method="prompt-lookup"),
    "prompt-lookup static tree": dict(spec_method="prompt-lookup", tree="0;1;2;0,0;0,1;1,0;0,0,0;0,0,0,0"),
    "prompt-lookup dynamic tree": dict(spec_method="prompt-lookup", tree="auto", tree_budget=12),
    "ngram chain": dict(spec_method="ngram"),
    "ngram dynamic tree": dict(spec_method="ngram", tree="auto", tree_budget=10),
    "hybrid dynamic tree (bundled table)": dict(spec_method="hybrid", tree="auto", tree_budget=8),
    # Shallow drafts are cheap but weak: few draft tokens keep these runs short.
    "draft self:3 chain": dict(spec_method="draft", draft_model="self:3", num_draft_tokens=2),
    "staged self:3 + prompt lookup": dict(spec_method="staged", draft_model="self:3", num_draft_tokens=3),
    "auto (the default)": dict(),
    "auto with the answer in its suffix cache": dict(),  # an earlier request's answer: the same text
}
REMEMBERS = "auto with the answer in its suffix cache"
# Drafters that copy from the prompt, and trees, get whole runs of drafts right on the copy-heavy
# prompts, so acceptance past a pass's first draft is exercised. Shallow drafts and chains from a
# table of unrelated text rarely keep two drafts in a row.
DEEP_ACCEPTS = {name for name in CONFIGS if name.startswith(("prompt-lookup", "hybrid", "auto")) or name.endswith("tree")}


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_speculative_equals_plain_greedy(default_engine, dense, ngram_table, config):
    options = dict(CONFIGS[config])
    if options.get("spec_method") == "ngram":
        options["ngram_model"] = ngram_table
    proposed = accepted = longest = 0
    methods = set()
    # `auto`, the default, on every prompt; each other method on one of either kind (fp32 is the
    # slowest format; test_quantized_model.py runs them on four prompts in the default format).
    # The table holds code: its copy-heavy prompt is the code.
    copies = PROMPTS[1] if options.get("spec_method") == "ngram" else PROMPTS[0]
    prompts = (copies, PROMPTS[4])
    if config.startswith("auto"):
        prompts = PROMPTS
    elif options.get("draft_model"):  # shallow layers: rejected often on any prompt, and dear in fp32
        prompts = (copies,)
    # The other methods' runs are shorter, as in the other formats' covering runs (dense decoding's
    # first tokens are its tokens at a shorter length): each still keeps and throws away drafts.
    tokens = MAX_TOKENS if config.startswith("auto") else SHORTER
    for prompt in prompts:
        default_engine.suffix_cache.clear()  # each run drafts from its own text, not another run's answer
        if config == REMEMBERS:
            default_engine.suffix_cache.add(default_engine.encode(prompt) + dense[prompt])
        result = default_engine.generate(prompt, max_tokens=tokens, ignore_eos=True, **options)
        assert result.token_ids == dense[prompt][:tokens], f"{config} differs on {prompt!r}"
        methods |= result.stats.method_passes.keys()
        proposed += result.stats.draft_tokens_proposed
        accepted += result.stats.draft_tokens_accepted
        longest = max(longest, *result.stats.accept_lengths)
    if config == REMEMBERS:  # the earlier answer, drafted whole chains at a time
        assert "suffix" in methods and accepted > 0.8 * proposed and longest > 6, (methods, accepted, proposed)
        return
    # Verification had work to do: drafts were proposed, some kept and some rejected.
    assert 0 < accepted < proposed, f"{config}: {accepted} of {proposed} draft tokens accepted"
    if config in DEEP_ACCEPTS:
        assert longest > 2, f"{config}: no pass kept more than {longest - 1} drafts"
    if config == "auto (the default)":  # auto copied, drafted from the table and drafted nothing, by turns
        assert methods == {"prompt-lookup", "ngram", "none"}


def test_a_draft_identical_to_the_target_is_always_accepted(default_engine, dense):
    layers = default_engine.config.num_hidden_layers
    for prompt in PROMPTS[:1]:
        result = default_engine.generate(prompt, max_tokens=SHORTER, ignore_eos=True, spec_method="draft",
                                         draft_model=f"self:{layers}", num_draft_tokens=6)
        assert result.token_ids == dense[prompt][:SHORTER]
        stats = result.stats
        # Every draft kept, but those of the last pass that ran past max_tokens, which are not counted.
        assert 0 <= stats.draft_tokens_proposed - stats.draft_tokens_accepted < 6 and stats.draft_tokens_accepted > 0
        assert stats.mean_acceptance_length > 6


def test_nothing_accepted_still_lossless(default_engine, dense):
    """A one-layer draft is almost always wrong: output unchanged, acceptance near zero."""
    for prompt in PROMPTS[3:4]:
        result = default_engine.generate(prompt, max_tokens=SHORTER, ignore_eos=True, spec_method="draft",
                                         draft_model="self:1", num_draft_tokens=3)
        assert result.token_ids == dense[prompt][:SHORTER]
        assert result.stats.draft_tokens_accepted <= result.stats.draft_tokens_proposed * 0.2
