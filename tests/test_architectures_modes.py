"""Every decoding mode on the architectures beyond Llama, through the engine as a user runs them: a
tiny random Gemma 3 (sliding windows of 6 keys, which every generation here outgrows; q/k and
sandwich norms, GeGLU, scaled embeddings, two RoPE bases) and a tiny Qwen 3 (q/k norms), on
specee's compiled kernels (int4) and on PyTorch's (fp32). Each lossless mode gives plain greedy
decoding's tokens; the exits run, and with a threshold that never fires give them too."""
import pytest
import torch

import specee
from helpers import TINY_ARCHITECTURES, pass_through_head, tiny_model_directory
from specee.drafters.eagle import EagleArtifact
from specee.drafters.kangaroo import Adapter, KangarooArtifact, KangarooSettings
from specee.drafters.ngram import NgramModel
from specee.exits.predictors import ExitArtifact, ExitPredictors, ExitSettings
from specee.model.fingerprint import weights_fingerprint

PROMPTS = ["the cat sat on the mat and the cat sat on the", "one two three four one two three", "hello there"]
MAX_TOKENS = 40
MODES = {
    "prompt-lookup": dict(spec_method="prompt-lookup"),
    "prompt-lookup tree": dict(spec_method="prompt-lookup", tree="auto", tree_budget=8, tree_node_cost=0.0),
    "ngram": dict(spec_method="ngram"),
    "ngram tree": dict(spec_method="ngram", tree="auto", tree_budget=6, tree_node_cost=0.0),
    "hybrid tree": dict(spec_method="hybrid", tree="auto", tree_budget=6, tree_node_cost=0.0),
    "draft self:2": dict(spec_method="draft", draft_model="self:2", num_draft_tokens=3),
    "staged self:2": dict(spec_method="staged", draft_model="self:2", num_draft_tokens=3),
    "eagle": dict(spec_method="eagle"),
    "eagle-copy": dict(spec_method="eagle-copy"),
    "kangaroo": dict(spec_method="kangaroo"),
    "auto": dict(),
    "exits that never fire": dict(exit="specee", exit_threshold=2.0),
}
TRAINED = {"ngram", "hybrid", "staged", "auto"}  # methods that take the n-gram table
# Trees are given a free node cost: the default follows the CPU tier's row price, and on a tier
# where rows are dear an untrained table's nodes never pay for themselves (the check would be empty).


@pytest.fixture(scope="module", params=[(name, compiled) for name in ("gemma3", "qwen3") for compiled in (True, False)],
                ids=lambda p: f"{p[0]}-{'compiled' if p[1] else 'pytorch'}")
def setup(request, tmp_path_factory):
    """(engine, its artifacts' paths): untrained drafters, which verification must keep lossless
    whatever they propose, and a table of the model's own text."""
    architecture, compiled = request.param
    directory = tmp_path_factory.mktemp(architecture)
    tiny_model_directory(directory / "model", seed=5, **TINY_ARCHITECTURES[architecture], intermediate_size=128)
    engine = specee.load(directory / "model", quantization="int4" if compiled else "none", compile=compiled)
    assert engine.model.uses_kernels == compiled
    model, fingerprint = engine.model, weights_fingerprint(engine.model)
    vocab = torch.arange(model.config.vocab_size)
    torch.manual_seed(0)
    paths = {kind: str(directory / f"{kind}.pt") for kind in ("ngram", "eagle", "kangaroo", "exits")}
    text = [engine.generate(p, max_tokens=60, ignore_eos=True, chat=False, spec_method="none").token_ids for p in PROMPTS]
    NgramModel.train(text, model.config.vocab_size, progress=False).save(paths["ngram"], engine.tokenizer.fingerprint)
    EagleArtifact(pass_through_head(model.config).state_dict(), vocab, fingerprint).save(paths["eagle"])
    KangarooArtifact(Adapter(model.config).state_dict(), vocab, fingerprint,
                     KangarooSettings(layers=1, eta=0.0, gamma=4)).save(paths["kangaroo"])
    layers = model.config.num_hidden_layers
    ExitArtifact(ExitPredictors(layers - 1, 12).state_dict(), vocab[:4], fingerprint,
                 ExitSettings(layers=[1, 2])).save(paths["exits"])
    return engine, paths


def options_for(mode: str, paths: dict) -> dict:
    options = dict(MODES[mode])
    method = options.get("spec_method", "auto")
    if method.split("-")[0] in TRAINED or mode.startswith("exits"):
        options["ngram_model"] = paths["ngram"]
    if method.startswith(("eagle", "kangaroo")):
        options["drafter"] = paths["eagle" if method.startswith("eagle") else "kangaroo"]
    if mode.startswith("exits"):
        options["exit_predictors"] = paths["exits"]
    return options


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_greedy_decodings_tokens(setup, mode):
    engine, paths = setup
    options = options_for(mode, paths)
    proposed = accepted = 0
    for prompt in PROMPTS:
        dense = engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, spec_method="none")
        result = engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, **options)
        assert result.token_ids == dense.token_ids, f"{mode} differs on {prompt!r}"
        proposed += result.stats.draft_tokens_proposed
        accepted += result.stats.draft_tokens_accepted
    if "spec_method" in options:  # identity is only worth something where drafts were kept and thrown away
        assert 0 < accepted < proposed, f"{mode}: {accepted} of {proposed} drafts accepted"


def test_exits_that_fire_emit_shallow_tokens_and_count_them(setup):
    engine, paths = setup
    result = engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, exit="specee",
                             exit_predictors=paths["exits"], exit_threshold=0.0, ngram_model=paths["ngram"])
    assert len(result.token_ids) == MAX_TOKENS
    assert result.stats.avg_forward_layers < engine.model.config.num_hidden_layers
