"""The model against Hugging Face on tiny random configs, and its pieces against each other."""
import pytest
import torch

from helpers import specee_from_hf, tiny_hf_model

CONFIGS = {
    "gqa-untied": dict(),
    "gqa-tied": dict(tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "llama3-rope": dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(model_type="qwen2"),
}


def full_forward(model, ids):
    cache = model.new_cache(len(ids) + 8)
    return model(torch.tensor(ids), torch.arange(len(ids)), cache)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hugging_face(name, pack):
    overrides = dict(CONFIGS[name])
    hf = tiny_hf_model(seed=1, **overrides)
    ours = specee_from_hf(hf, pack=pack)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        got = full_forward(ours, ids)
    assert expected.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_rope_scaling_changes_logits():
    """Guards the llama3 case above against passing because scaling was silently ignored."""
    plain = specee_from_hf(tiny_hf_model(seed=1))
    scaled = specee_from_hf(tiny_hf_model(seed=1, **CONFIGS["llama3-rope"]))
    ids = list(range(60))
    with torch.no_grad():
        assert not torch.allclose(full_forward(plain, ids), full_forward(scaled, ids), atol=1e-3)


def test_logits_rows_equal_columns_of_full_logits():
    model = specee_from_hf(tiny_hf_model(seed=2))
    h = model.norm(torch.randn(5, 64))
    rows = torch.tensor([3, 96, 0, 41])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(h, rows), model.logits(h)[:, rows], atol=1e-5, rtol=1e-5)


def test_forward_is_the_loop_over_the_pieces():
    model = specee_from_hf(tiny_hf_model(seed=3))
    ids = torch.tensor([5, 9, 2, 77])
    positions = torch.arange(4)
    with torch.no_grad():
        by_forward = model(ids, positions, model.new_cache(8))
        cache = model.new_cache(8)
        h = model.embed(ids)
        angles = model.angles(positions)
        for layer in model.layers:
            h = layer(h, angles, cache)
        by_pieces = model.logits(model.norm(h))
    torch.testing.assert_close(by_forward, by_pieces, atol=0, rtol=0)


def test_weight_bytes_counts_every_matrix_once():
    hf = tiny_hf_model(seed=0)
    ours = specee_from_hf(hf, pack=False)
    # HF's parameters minus the embedding table (only one row is read per token).
    expected = sum(p.numel() for n, p in hf.named_parameters() if "embed_tokens" not in n) * 4
    assert ours.weight_bytes == expected
