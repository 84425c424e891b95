"""The compiled CPU kernels (`specee/model/kernels/`): each against a plain reference, each row's
result independent of the other rows of the call, and the build cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specee.model.integer_linear import IntegerLinear
from specee.model.kernels import KernelsUnavailable, build, build_directory, cpu_kernels
from specee.model.quantize import quantize_int4, quantize_int8, quantized_linear
from specee.model.rope import apply_rope, rope_angles

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    assert module is not None, "the CPU kernels must build on the test machines (g++ and AVX-512 VNNI)"
    return module


def rows(T: int, K: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, K, generator=torch.Generator().manual_seed(seed)) * 3


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: each row in blocks of 32, scaled to int8 by the block's largest
    magnitude and rounded to nearest even, as fp64 values."""
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0))
    return (codes.double() * scale.double()).view_as(x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(960, 576), (97, 128), (16, 1536)])
def test_integer_linear_is_int8_activations_times_the_dequantized_weight(kernels, bits, shape):
    N, K = shape
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    weight = quantize_int4(w, 32) if bits == 4 else quantize_int8(w)
    layer = quantized_linear(weight, kernels=kernels)
    assert isinstance(layer, IntegerLinear) and layer.bits == bits
    x = rows(9, K)
    expected = int8_activations(x) @ weight.dequantize().double().T
    out = layer(x)
    assert out.shape == (9, N) and out.dtype == torch.float32
    # Integer sums are exact; only the fp32 scaling of each block rounds.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(kernels, bits):
    w = torch.randn(200, 576, generator=torch.Generator().manual_seed(2)) * 0.05  # 200: a partial tile of 16
    layer = quantized_linear(quantize_int4(w, 32) if bits == 4 else quantize_int8(w), kernels=kernels)
    x = rows(40, 576, seed=3)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for T in range(2, 41):
        assert torch.equal(layer(x[:T]), alone[:T]), f"{T} rows"
    assert torch.equal(layer(x.flip(0)), alone.flip(0))


def test_a_matrix_whose_inputs_do_not_split_into_blocks_stays_on_aten(kernels):
    from specee.model.quantize import Int8Linear

    layer = quantized_linear(quantize_int8(torch.randn(8, 112)), kernels=kernels)
    assert isinstance(layer, Int8Linear)


def attention_inputs(T: int, past: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(3, 256, 64, generator=g), torch.randn(3, 256, 64, generator=g)
    return torch.randn(T, 9, 64, generator=g), keys, values


NO_MASK = torch.empty(0, dtype=torch.uint8)


def test_attention_equals_pytorch_and_each_row_alone(kernels):
    past, T = 100, 13
    q, keys, values = attention_inputs(T, past)
    visible = torch.arange(past + 1, past + T + 1)
    out = kernels.attention(q, keys, values, visible, NO_MASK, 0, past + T)
    for t in range(T):
        S = past + t + 1
        expected = F.scaled_dot_product_attention(q[t].view(3, 3, 64)[None], keys[None, :, :S], values[None, :, :S])
        torch.testing.assert_close(out[t], expected.reshape(-1), rtol=1e-5, atol=1e-5)
        alone = kernels.attention(q[t:t + 1].contiguous(), keys, values, visible[t:t + 1], NO_MASK, 0, S)
        assert torch.equal(alone[0], out[t]), f"row {t}"


def test_a_tree_row_attends_as_it_would_after_its_path_was_compacted(kernels):
    """A tree's row sees the prefix and its ancestors, scattered among the draft's slots; after
    acceptance the path is compacted next to the prefix. Both must give the same bits."""
    past, T = 50, 16
    q, keys, values = attention_inputs(T, past, seed=1)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i))) for i in range(1, T)]
    mask = torch.zeros(T, T, dtype=torch.uint8)
    for i in range(T):
        node = i
        while node >= 0:
            mask[i, node] = 1
            node = parents[node]
    assert mask.sum(1).max() > 2, "the tree must have paths deeper than one node"
    out = kernels.attention(q, keys, values, torch.empty(0, dtype=torch.long), mask, past, past + T)
    for i in range(T):
        index = torch.cat((torch.arange(past), past + mask[i].nonzero().flatten()))
        compact_k, compact_v = torch.zeros_like(keys), torch.zeros_like(values)
        compact_k[:, :len(index)], compact_v[:, :len(index)] = keys[:, index], values[:, index]
        alone = kernels.attention(q[i:i + 1].contiguous(), compact_k, compact_v, torch.tensor([len(index)]), NO_MASK, 0,
                                  len(index))
        assert torch.equal(alone[0], out[i]), f"row {i}"


def test_rotate_and_store_rounds_as_pytorch_rope_and_writes_the_cache(kernels):
    T, heads, kv_heads, hd, start = 5, 4, 2, 32, 7
    qkv = rows(T, (heads + 2 * kv_heads) * hd, seed=4)
    angles = rope_angles(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), torch.arange(start, start + T),
                         torch.float32)
    keys, values = torch.zeros(kv_heads, 16, hd), torch.zeros(kv_heads, 16, hd)
    q = kernels.rotate_and_store(qkv, angles.cos.reshape(T, hd), angles.sin.reshape(T, hd), keys, values, start, heads)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * hd].view(T, heads + kv_heads, hd), angles)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(keys[:, start:start + T], qk[:, heads:].transpose(0, 1))
    assert torch.equal(values[:, start:start + T], qkv[:, (heads + kv_heads) * hd:].view(T, kv_heads, hd).transpose(0, 1))
    assert not keys[:, :start].any() and not keys[:, start + T:].any()


def test_norm_and_gate_equal_pytorch_and_each_row_alone(kernels):
    import torch.nn.functional as F

    x, weight = rows(7, 576, seed=3), torch.randn(576, generator=torch.Generator().manual_seed(4))
    normed = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(normed, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    gate_up = rows(7, 2 * 1536, seed=5)
    gated = kernels.silu_mul(gate_up)
    torch.testing.assert_close(gated, F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], rtol=1e-5, atol=1e-5)
    for t in range(7):
        assert torch.equal(kernels.rms_norm(x[t:t + 1].contiguous(), weight, 1e-5), normed[t:t + 1])
        assert torch.equal(kernels.silu_mul(gate_up[t:t + 1].contiguous()), gated[t:t + 1])


def run_python(code: str, cwd=None, **env) -> subprocess.CompletedProcess:
    """`code` in a new process that imports the checkout under test, whatever is installed."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=cwd)


def test_a_second_process_reuses_the_built_kernels_from_any_working_directory(kernels, tmp_path):
    directory = build_directory()
    library = next(directory.glob("*.so"))
    log = (directory / ".ninja_log").read_text()
    built_at = library.stat().st_mtime_ns
    done = run_python("from specee.model.kernels import cpu_kernels; assert cpu_kernels() is not None", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr
    assert library.stat().st_mtime_ns == built_at
    assert (directory / ".ninja_log").read_text() == log  # ninja ran no build step


def test_without_a_compiler_the_kernels_are_unavailable_with_a_reason(monkeypatch, tmp_path):
    import specee.model.kernels as kernels_module

    monkeypatch.setattr(kernels_module.shutil, "which", lambda name: None)
    with pytest.raises(KernelsUnavailable, match="no C\\+\\+ compiler"):
        build(tmp_path)


@pytest.mark.slow
def test_a_damaged_cache_is_rebuilt_with_a_warning(kernels, tmp_path):
    """A corrupt shared object in the cache folder: the next process warns, builds it again and runs."""
    import shutil

    target = tmp_path / "kernels" / build_directory().name
    shutil.copytree(build_directory(), target)
    library = next(target.glob("*.so"))
    library.write_bytes(b"not a shared object")
    done = run_python("from specee.model.kernels import build; print(build().integer_linear is not None)",
                      SPECEE_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "could not be loaded" in done.stderr and "rebuilding" in done.stderr
    assert done.stdout.strip().endswith("True")
    assert next(target.glob("*.so")).read_bytes()[:4] == b"\x7fELF"
