"""Speculative options become strategies: every option is honoured or refused, never dropped."""
import pytest
import torch

from helpers import tiny_model
from specee.drafters.base import Proposer
from specee.drafters.draft_model import DraftModel, fit_vocabulary
from specee.engine import Engine
from specee.model.fingerprint import weights_fingerprint
from specee.strategies.config import SpecConfig
from specee.strategies.speculative import Speculative
from specee.verification.tree import static_tree


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    model = tiny_model(seed=2, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2)
    return Engine(model, tiny_tokenizer)


@pytest.mark.parametrize("options,message", [
    (dict(tree=""), "an empty tree"),
    (dict(tree="   "), "an empty tree"),
    (dict(tree="0;1", tree_width=2), "dynamic trees only"),
    (dict(tree_min_prob=0.2), "dynamic trees only"),
    (dict(tree_node_cost=0.1), "dynamic trees only"),
    (dict(tree="auto", tree_min_prob=1.5), r"tree_min_prob must be in \[0, 1\]"),
    (dict(confidence_threshold=0.5), "needs a drafter with probabilities"),
    (dict(method="ngram", tree="auto", confidence_threshold=0.5), "trees stop growing at tree_min_prob"),
    (dict(method="teleport"), "unknown spec_method 'teleport'"),
    (dict(colour="red"), "unknown options"),
])
def test_options_that_would_be_ignored_are_refused(engine, options, message):
    options = {"method": "prompt-lookup", **options}
    with pytest.raises(ValueError, match=message):
        engine.strategy(options.pop("method"), **options)


def test_static_trees_honour_every_rank(engine):
    shape = static_tree([(0,), (4,), (0, 5)])
    assert shape.width == 6
    strategy = engine.strategy("prompt-lookup", tree="0;4;0,5")
    asked = []

    class Recorder(Proposer):
        drafts_trees = True

        def candidates(self, context, k):
            asked.append(k)
            return [(token, 1.0 / (token + 1)) for token in range(k)]

    draft = strategy.draft(Recorder(), [1, 2, 3], length=8)
    assert set(asked) == {6}
    assert draft.tokens == [0, 4, 5] and draft.parents == [-1, -1, 0]


def test_strategies_are_named_for_their_method_and_shape(engine):
    """The name labels the server's metrics and the bench's rows."""
    assert engine.strategy("prompt-lookup").name == "prompt-lookup"
    assert engine.strategy("prompt-lookup", tree="auto", tree_width=3).name == "prompt-lookup-tree"


def test_chain_only_proposer_refuses_trees(engine):
    with pytest.raises(ValueError, match="drafts chains only"):
        engine.strategy("staged", draft_model="self:1", tree="auto")


@pytest.mark.slow
def test_bundled_table_loads_for_any_model_with_the_tokenizer(default_engine):
    """The n-gram table is tied to the tokenizer, not to the weights or config around it."""
    model = tiny_model(seed=2, vocab_size=default_engine.config.vocab_size, num_hidden_layers=2)
    engine = Engine(model, default_engine.tokenizer)
    strategy = engine.strategy("ngram")
    result = engine.generate("Hello there", max_tokens=8, strategy=strategy, ignore_eos=True)
    assert result.stats.draft_tokens_proposed > 0  # the table drafted for the other model


def test_weights_fingerprint_ignores_dtype_and_tells_weights_apart():
    model = tiny_model(seed=3, pack=False)
    same_in_bf16 = tiny_model(seed=3, pack=False).to(torch.bfloat16)
    other = tiny_model(seed=4, pack=False)
    assert weights_fingerprint(model) == weights_fingerprint(same_in_bf16)
    assert weights_fingerprint(model) != weights_fingerprint(other)


def test_padded_draft_vocabulary_scores_the_targets_tokens(engine):
    """A draft with a padded embedding (same tokenizer, larger vocab_size) drafts and samples over
    the target's vocabulary only; greedy speculation still equals dense decoding."""
    target = tiny_model(seed=6, vocab_size=97)
    padded = tiny_model(seed=5, vocab_size=128)
    prompt = [1, 2, 3, 1, 2]
    dense = Engine(target, engine.tokenizer).generate(prompt, max_tokens=12, ignore_eos=True, chat=False, spec_method="none")
    for params in (dict(), dict(temperature=1.0, seed=0)):
        strategy = Speculative(lambda: DraftModel(padded, vocab_size=97), num_draft_tokens=3)
        result = Engine(target, engine.tokenizer).generate(prompt, max_tokens=12, ignore_eos=True, strategy=strategy,
                                                          **params)
        assert result.stats.draft_tokens_proposed > 0
        assert all(t < 97 for t in result.token_ids)
        if not params:
            assert result.token_ids == dense.token_ids
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert fit_vocabulary(logits, 2).tolist() == [[1.0, 2.0]]
    assert fit_vocabulary(logits, 4)[0, 3] == float("-inf")


def test_spec_config_rejects_unknown_keywords():
    with pytest.raises(ValueError, match=r"unknown options \['warp'\]"):
        SpecConfig.from_keywords({"spec_method": "ngram", "warp": 9})


@pytest.mark.slow
def test_bundled_table_loads_for_the_models_own_hugging_face_directory(tmp_path):
    """The same model in Hugging Face layout, whose config.json carries the fields HF writes
    (transformers_version, architectures, torch_dtype), still takes the bundled table."""
    import json

    import specee
    from specee.model.loading import default_model_path, resolve_model_dir

    from safetensors.torch import save_file

    from specee.model.gguf_weights import read_gguf_weights

    source = resolve_model_dir(default_model_path())  # the GGUF file's config and tokenizer
    for file in source.iterdir():
        if file.suffix != ".pt":  # not the packed-weights caches
            (tmp_path / file.name).symlink_to(file)
    (tmp_path / "config.json").unlink()
    weights = read_gguf_weights(default_model_path(), "none").state_dict  # fp32, Hugging Face names
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(tmp_path / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config |= {"transformers_version": "4.99.0", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = specee.load(tmp_path)
    result = engine.generate("Write a haiku.", max_tokens=8, spec_method="hybrid", tree="auto")
    assert result.completion_tokens == 8 or result.finish_reason == "stop"
