"""The default model's draft sizes in every CPU tier and weight format, from first principles: its
shape gives a row's multiply-adds, each format's layout the bytes a pass reads, and the row prices
measured per tier (BENCHMARKS.md, "CPU tiers") the price; the sizes are the ones each tier's tuning
chose. Nothing here is read from the code under test but the function that prices a row and the
builder that sizes drafts, so a rounded constant or a threshold on a measured value shows."""
from types import SimpleNamespace

import pytest

from specee.model.quantize import extra_row_cost
from specee.strategies.builder import COSTLY_ROW, DEAR_ROW, resolve
from specee.strategies.config import SpecConfig

# SmolLM2-135M-Instruct
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 30, 576, 9, 3, 64, 1536, 49152
LAYER_ROWS = (HEADS + 2 * KV_HEADS) * HEAD_DIM + HIDDEN + 2 * FFN + HIDDEN  # qkv, o, gate+up, down
LAYER_WEIGHTS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN
HEAD_WEIGHTS = VOCAB * HIDDEN
NORMS = 2 * HIDDEN * 4  # two fp32 norms a layer
FINAL_NORM = HIDDEN * 4
MULTIPLY_ADDS = LAYERS * LAYER_WEIGHTS + HEAD_WEIGHTS


def pass_bytes(fmt: str) -> int:
    int4_layers = LAYERS * (LAYER_WEIGHTS // 2 + LAYER_WEIGHTS // 32 * 4 + NORMS)  # bf16 scale + zero per 32
    int8_head = HEAD_WEIGHTS + VOCAB * 8  # an fp32 scale and zero a row
    return {
        "gguf": int4_layers + HEAD_WEIGHTS + HEAD_WEIGHTS // 32 * 2 + FINAL_NORM,  # Q4_1 layers, Q8_0 head (an fp16 scale per 32)
        "int4": int4_layers + int8_head + FINAL_NORM,
        "int8": LAYERS * (LAYER_WEIGHTS + LAYER_ROWS * 8 + NORMS) + int8_head + FINAL_NORM,
    }[fmt]


MEASURED = {"avx512": 0.15, "avxvnni": 0.2, "avx2": 0.2, "neon": 0.2, "portable": 1.0}
# (chain length, tree node cost) that each tier's tuning chose for the default model.
AVX512_SIZES, AVX2_SIZES = (4, 0.3), (2, 0.5)
INTENDED = {
    ("avx512", "gguf"): AVX512_SIZES, ("avx512", "int4"): AVX512_SIZES, ("avx512", "int8"): AVX512_SIZES,
    ("avx2", "gguf"): AVX2_SIZES, ("avx2", "int4"): AVX2_SIZES, ("avx2", "int8"): AVX512_SIZES,
    ("avxvnni", "gguf"): AVX2_SIZES, ("neon", "gguf"): AVX2_SIZES, ("portable", "gguf"): AVX2_SIZES,
}


@pytest.mark.parametrize("tier,fmt", INTENDED, ids=lambda v: str(v))
def test_the_default_models_drafts_are_sized_as_its_tiers_tuning_chose(tier, fmt):
    price = extra_row_cost(tier, MULTIPLY_ADDS / pass_bytes(fmt))
    expected = MEASURED[tier] * (MULTIPLY_ADDS / pass_bytes(fmt)) / (MULTIPLY_ADDS / pass_bytes("gguf"))
    assert price == pytest.approx(expected, rel=1e-12)
    for threshold in (COSTLY_ROW, DEAR_ROW):  # no cliff: a few percent either way keeps the sizes
        assert abs(price - threshold) > 0.05 * threshold, f"{tier} {fmt}: price {price} sits on {threshold}"
    model = SimpleNamespace(extra_row_cost=price)
    chain, node_cost = INTENDED[tier, fmt]
    assert resolve(SpecConfig(method="prompt-lookup"), model).num_draft_tokens == chain
    assert resolve(SpecConfig(method="hybrid", tree="auto"), model).tree_node_cost == node_cost


def test_the_default_format_is_priced_at_the_measured_value_exactly():
    for tier, measured in MEASURED.items():
        assert extra_row_cost(tier, MULTIPLY_ADDS / pass_bytes("gguf")) == measured, tier


@pytest.mark.slow
def test_the_real_models_bytes_and_multiply_adds_are_these():
    import specee

    for fmt in ("gguf", "int4", "int8"):
        model = specee.load(quantization=fmt).model
        assert model.layers_bytes(range(LAYERS)) + model.head_bytes == pass_bytes(fmt), fmt
        assert model.multiply_adds_per_byte == MULTIPLY_ADDS / pass_bytes(fmt), fmt
