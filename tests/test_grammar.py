"""Structured output: llguidance's masks on every row of a pass, each after its own draft path,
drafts the grammar refuses dropped before the pass, and the tokens it forces drafted for free, so
greedy constrained decoding is token-identical to dense constrained decoding and sampling keeps
the constrained distribution (the chi-square cases here, as in tests/test_speculative_sampling.py)."""
import dataclasses
import json

import pytest
import torch

from helpers import chi_square_p_value, decode, first_tokens, tiny_model
from test_batch_invariance import kernel_model
from specee.drafters.draft_model import DraftModel
from specee.drafters.prompt_lookup import PromptLookup
from specee.engine import Engine
from specee.grammar import Constraint, Grammar, GrammarCompiler
from specee.sampling import Sampler, SamplingParams, processed_probs
from specee.stats import GenerationStats
from specee.strategies.base import DecodeState
from specee.strategies.dense import Autoregressive
from specee.strategies.speculative import Speculative
from specee.tokenizer import Tokenizer
from specee.verification.draft import Draft
from specee.verification.tree import static_tree

# --- A tokenizer of eleven letters and an end token, so masks can be read by eye ----------------
LETTERS = "abcdefghijk"
EOS = len(LETTERS)
# After "i": pairs of a low letter (a-d) and a high one (e-h) in either order, or a lone "j"; so
# which letters may come next depends on the path.
PAIRS = r"i([a-d][e-h]|[e-h][a-d]|j)*"


def letter_tokenizer(directory) -> Tokenizer:
    from tokenizers import Tokenizer as FastTokenizer, decoders, models, pre_tokenizers

    fast = FastTokenizer(models.BPE(vocab={letter: i for i, letter in enumerate(LETTERS)}, merges=[]))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.add_special_tokens(["<eos>"])
    directory.mkdir(parents=True, exist_ok=True)
    fast.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory, eos_token_ids=[EOS])


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    return GrammarCompiler(letter_tokenizer(tmp_path_factory.mktemp("letters")), vocab_size=EOS + 1)


def ids(text: str) -> list[int]:
    return [LETTERS.index(letter) for letter in text]


def allowed(mask: torch.Tensor) -> str:
    return "".join(LETTERS[i] if i < EOS else "$" for i in mask.nonzero().flatten().tolist())


def test_each_rows_mask_follows_its_own_path_and_refused_paths_stay_open(letters):
    constraint = letters.constraint(Grammar.regex(PAIRS))
    constraint.advance(ids("i"))
    masks = constraint.masks([[], ids("a"), ids("ae"), ids("j"), ids("aa")])
    assert [allowed(row) for row in masks[:4]] == ["abcdefghj$", "efgh", "abcdefghj$", "abcdefghj$"]
    assert masks[4].all()  # "aa" is refused: no accepted path reaches that row
    constraint.advance(ids("ie"))  # the matcher moved on; the masks above rolled back what they took
    assert allowed(constraint.masks([[]])[0]) == "abcd"


def test_drafts_lose_the_nodes_the_grammar_refuses_with_their_subtrees(letters):
    constraint = letters.constraint(Grammar.regex(PAIRS))
    constraint.advance(ids("i"))
    # Nodes: a, e, a->f, a->b (refused), a->b->e (below a refused node), e->a.
    draft = Draft(ids("aefbea"), [-1, -1, 0, 0, 3, 1], q=torch.eye(EOS + 1)[ids("aefbea")])
    kept = constraint.admissible(draft)
    assert (kept.tokens, kept.parents) == (ids("aefa"), [-1, -1, 0, 1])
    torch.testing.assert_close(kept.q, draft.q[[0, 1, 2, 5]])


def test_forced_tokens_and_bad_grammars(letters):
    constraint = letters.constraint(Grammar.regex("ijk(a|b)"))
    assert constraint.forced() == ids("ijk")
    constraint.advance(ids("ijk"))
    assert constraint.forced() == []
    with pytest.raises(ValueError, match="regex"):
        letters.check(Grammar.regex("[a-"))
    with pytest.raises(ValueError, match="JSON schema"):
        Grammar.json_schema("{not json")
    with pytest.raises(ValueError, match="cannot be used"):
        letters.check(Grammar.json_schema({"type": "objectx"}))


def test_a_committed_token_the_grammar_refuses_is_an_error_not_a_wrong_answer(letters):
    constraint = letters.constraint(Grammar.regex(PAIRS))
    with pytest.raises(RuntimeError, match="broke the grammar"):
        constraint.advance(ids("ia"))
        constraint.advance(ids("iaa"))


# --- Greedy: every strategy's constrained output is dense decoding's constrained output --------
@pytest.fixture(scope="module")
def words(tiny_tokenizer):
    return GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size), tiny_tokenizer


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return tiny_model(seed=4, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=3)


# Fixed text the grammar forces (free drafts) between choices the model makes.
SENTENCES = Grammar.regex(r"Answer: (red|green|blue)(, and then the (cat|dog|fox|mat) (sat|looked) on the (mat|dog))+")
PROMPT_TEXT = "the cat sat on the mat and looked at the dog. Answer: red, and then the cat sat on the mat"


STRATEGIES = {
    "prompt-lookup chain": lambda model: Speculative(lambda: PromptLookup(), num_draft_tokens=6),
    "draft chain": lambda model: Speculative(lambda: DraftModel(model, num_layers=2), num_draft_tokens=4),
    "draft static tree": lambda model: Speculative(
        lambda: DraftModel(model, num_layers=3), num_draft_tokens=3,
        tree=static_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])),
}


def constrained(model, words, strategy, steps=60):
    compiler, tokenizer = words
    prompt = tokenizer.encode(PROMPT_TEXT)
    return decode(model, strategy, prompt, steps=steps, constraint=compiler.constraint(SENTENCES))


@pytest.mark.parametrize("name", STRATEGIES)
def test_greedy_speculative_under_a_grammar_equals_dense_under_it(model, words, name):
    dense, dense_stats, _ = constrained(model, words, Autoregressive())
    text = words[1].decode(dense)
    assert text.startswith("Answer: ") and ", and then the " in text  # the grammar held
    assert decode(model, Autoregressive(), words[1].encode(PROMPT_TEXT), steps=60)[0] != dense  # and mattered
    speculative, stats, _ = constrained(model, words, STRATEGIES[name](model))
    assert speculative == dense
    assert stats.draft_tokens_accepted > 0 and stats.target_passes < dense_stats.target_passes


def test_forced_text_is_drafted_for_free(model, words):
    """Prompt lookup finds nothing to copy in an empty prompt: its passes that keep drafts are the
    grammar's forced text."""
    compiler, tokenizer = words
    prompt = tokenizer.encode("one two")
    out, stats, _ = decode(model, Speculative(lambda: PromptLookup(), num_draft_tokens=6), prompt, steps=40,
                           constraint=compiler.constraint(SENTENCES))
    dense, _, _ = decode(model, Autoregressive(), prompt, steps=40, constraint=compiler.constraint(SENTENCES))
    assert out == dense
    assert stats.draft_tokens_accepted >= len(tokenizer.encode("Answer: ")) - 1


@pytest.mark.parametrize("name", ["draft chain", "draft static tree"])
def test_the_test_catches_rows_masked_for_the_root_alone(model, words, name, monkeypatch):
    dense, _, _ = constrained(model, words, Autoregressive())
    masks = Constraint.masks
    monkeypatch.setattr(Constraint, "masks", lambda self, paths: masks(self, [[]] * len(paths)))
    monkeypatch.setattr(Constraint, "admissible", lambda self, draft: draft)
    try:
        speculative = constrained(model, words, STRATEGIES[name](model))[0]
    except RuntimeError:  # a row chose a token its path's grammar refuses
        speculative = None
    assert speculative != dense


# --- Sampling: the constrained joint distribution of two speculative tokens ---------------------
VOCAB = EOS + 1
PROMPT = ids("abcdabce")
ROOT = LETTERS.index("i")  # forced first token (the grammar's own first letter)
SAMPLES = 2000
P_VALUE_THRESHOLD = 1e-4


@pytest.fixture(scope="module")
def letter_model():
    # Int8 weights on the compiled kernels, as users decode: a pass is one kernel call, where
    # PyTorch's own kernels make dozens a layer. A seed whose top-p case leaves 16 pairs possible.
    return kernel_model("int8", seed=10, vocab_size=VOCAB, num_hidden_layers=3)


def exact_joint(model, letters, params) -> torch.Tensor:
    """P(t2, t3 | prompt, root) under plain sampling with the grammar: [VOCAB * VOCAB]."""
    def next_probs(output):
        inputs = PROMPT + output
        logits = model(torch.tensor(inputs), torch.arange(len(inputs)), model.new_cache(len(inputs)))[-1:]
        constraint = letters.constraint(Grammar.regex(PAIRS))
        sampler = Sampler(params, prompt_length=len(PROMPT), constraint=constraint)
        return processed_probs(sampler.adjusted(logits, inputs), params)[0].double()

    with torch.no_grad():
        first = next_probs([ROOT])
        rows = torch.stack([next_probs([ROOT, t]) if first[t] > 0 else torch.zeros(VOCAB, dtype=torch.float64)
                            for t in range(VOCAB)])
    return (first[:, None] * rows).flatten()


def sample_joint(model, letters, make_strategy, params, samples: int = SAMPLES) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    strategy = make_strategy(model)
    grammar = letters.constraint(Grammar.regex(PAIRS)).matcher  # compiled once, copied per sample
    with torch.inference_mode():  # as the engine decodes (and quicker per call than no_grad)
        prefilled = model.new_cache(64)  # the prompt once; every sample decodes from a copy
        hidden = model.hidden(torch.tensor(PROMPT), torch.arange(len(PROMPT)), prefilled)
        logits = model.logits(model.norm(hidden[-1:]))
        for seed in range(samples):
            sampler = Sampler(dataclasses.replace(params, seed=seed), prompt_length=len(PROMPT),
                              constraint=Constraint(grammar.deep_copy(), VOCAB, [EOS]))
            state = DecodeState(model, prefilled.copy(), list(PROMPT), logits, sampler, GenerationStats(), hidden)
            out = first_tokens(strategy, state, 3)
            assert out[0] == ROOT
            counts[out[1] * VOCAB + out[2]] += 1
    return counts


def sampled_chain(model):
    """Chains drawn from a one-layer draft's distribution (q): refused nodes stay, and rejection
    sampling turns them down."""
    return Speculative(lambda: DraftModel(model, num_layers=1), num_draft_tokens=3, adaptive=False)


def top_k_tree(model):
    """Deterministic top-k nodes: the grammar's refusals are dropped before the pass."""
    return Speculative(lambda: DraftModel(model, num_layers=2), num_draft_tokens=3,
                       tree=static_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]))


SAMPLING_CASES = {
    "top-k tree, temperature": (top_k_tree, SamplingParams(temperature=1.0)),
    "sampled chain, top-p": (sampled_chain, SamplingParams(temperature=0.9, top_p=0.9)),
}


@pytest.mark.slow  # a few seconds a case: the full run's
@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_speculative_sampling_under_a_grammar_matches_plain_sampling_under_it(letter_model, letters, case):
    make_strategy, params = SAMPLING_CASES[case]
    expected = exact_joint(letter_model, letters, params)
    assert (expected > 0).sum() > 10  # many pairs possible, and which depends on the first
    counts = sample_joint(letter_model, letters, make_strategy, params)
    assert counts[expected == 0].sum() == 0  # nothing the grammar refuses
    assert chi_square_p_value(counts, expected) > P_VALUE_THRESHOLD


@pytest.mark.slow
def test_the_sampling_test_catches_rows_masked_for_the_root_alone(letter_model, letters, monkeypatch):
    masks = Constraint.masks
    monkeypatch.setattr(Constraint, "masks", lambda self, paths: masks(self, [[]] * len(paths)))
    monkeypatch.setattr(Constraint, "admissible", lambda self, draft: draft)
    params = SamplingParams(temperature=1.0)
    try:  # a quarter of the cases' samples: caught with fewer, it is caught with all of them
        counts = sample_joint(letter_model, letters, top_k_tree, params, SAMPLES // 4)
    except RuntimeError:  # a row chose a letter its path's grammar refuses
        return
    monkeypatch.undo()
    expected = exact_joint(letter_model, letters, params)
    assert counts[expected == 0].sum() > 0 or chi_square_p_value(counts, expected) < P_VALUE_THRESHOLD


# --- The engine's option ------------------------------------------------------------------------
def test_the_engine_takes_a_grammar_and_refuses_what_cannot_follow_one(tiny_tokenizer):
    engine = Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer)
    result = engine.generate("the cat", max_tokens=40, grammar=Grammar.regex("(red|green|blue)(, (red|green|blue)){2}"))
    assert result.finish_reason == "stop"
    parts = result.text.split(", ")
    assert len(parts) == 3 and set(parts) <= {"red", "green", "blue"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    answer = engine.generate("the cat", max_tokens=40, grammar=Grammar.json_schema(schema), spec_method="prompt-lookup")
    if answer.finish_reason == "stop":
        assert set(json.loads(answer.text)) == {"n"}
    else:  # a random model may write digits until the limit
        assert answer.text.startswith('{"n": ') and answer.completion_tokens == 40
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.generate("the cat", max_tokens=4, grammar=Grammar.json_object(), ignore_eos=True)
    with pytest.raises(ValueError, match="cannot be used"):
        engine.generate("the cat", max_tokens=4, grammar=Grammar.regex("(unclosed"))


@pytest.mark.slow
def test_a_regex_too_complex_for_the_default_vocabulary_is_refused_before_generation():
    """llguidance builds `(.{0,30}){0,30}x`, but on a 49k-token vocabulary its lexer outgrows its
    limits at the first mask: the check that runs before generation says so (a 400 at the server)
    rather than letting the answer end empty, its constraint silently broken."""
    from specee.loader import read_config, resolve_model_dir
    from specee.model.loading import default_model_path

    directory = resolve_model_dir(default_model_path())
    config = read_config(directory)
    compiler = GrammarCompiler(Tokenizer(directory, config.eos_token_ids), config.vocab_size)
    with pytest.raises(ValueError, match="the regex cannot be used: lexer error: too many expressions constructed"):
        compiler.check(Grammar.regex("(.{0,30}){0,30}x"))
    compiler.check(Grammar.regex("(.{0,30}){0,3}x"))  # a smaller one runs
