"""Batch invariance of the whole forward on the CPU kernels: in every weight format and every CPU
tier this machine runs, each row of a pass over a chain or a tree of 1..32 new tokens gets exactly
the logits a one-token pass over its path gives, and every tier gives the portable tier's logits.
Lossless speculation (and a server batching requests) rests on it."""
from __future__ import annotations

import random
import time

import pytest
import torch

from helpers import TINY_ARCHITECTURES, cpu_tier_params, threads, tiny_hf_model
from specee.model.config import LlamaConfig
from specee.model.cpu_packing import pack_linears
from specee.model.kernel_install import with_kernels
from specee.model.kernels import cpu_kernels, load_tier
from specee.model.loading import LoadedWeights, build_model
from specee.model.quantize import quantize_model

FORMATS = ["none", "int8", "int4"]


def kernel_model(quantization: str, seed: int = 0, dtype=torch.float32, tier: str | None = None,
                 architecture: str = "llama", edit=None, **overrides):
    """A tiny random model of `architecture` (TINY_ARCHITECTURES) on the CPU kernels, in `tier`
    (default: the best this CPU runs; the matrices' inputs split into blocks of 32); `overrides`
    change its config (vocab_size, num_hidden_layers, ...); `edit(state)` changes its Hugging Face
    weights in place before they are packed."""
    kernels = load_tier(tier) if tier else cpu_kernels()
    assert kernels is not None
    shape = TINY_ARCHITECTURES[architecture] | dict(intermediate_size=128, vocab_size=160) | overrides
    hf = tiny_hf_model(seed, **shape)
    config = LlamaConfig.from_dict(hf.config.to_dict())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if edit is not None:
        edit(state)
    model = build_model(LoadedWeights(config, state, None), dtype, "cpu", kernels)
    quantize_model(model, quantization, kernels=kernels)
    pack_linears(model)
    return with_kernels(model, kernels)


def random_tree(rng: random.Random, size: int, chain: bool) -> list[int]:
    """Parents of `size` draft nodes in layout order (-1: a child of the last committed token)."""
    return [i - 1 for i in range(size)] if chain else [rng.randrange(-1, i) for i in range(size)]


def paths(parents: list[int]) -> list[list[int]]:
    """For each node, the nodes from the root down to it."""
    found = []
    for node in range(len(parents)):
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        found.append(path[::-1])
    return found


def tree_pass(model, prefix: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Logits of every node of a draft tree, verified in one pass after `prefix`: [T, vocab]."""
    node_paths = paths(parents)
    mask = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
    for node, path in enumerate(node_paths):
        mask[node, path] = True
    positions = torch.tensor([len(prefix) + len(path) - 1 for path in node_paths])
    cache = model.new_cache(len(prefix) + len(tokens))
    with torch.inference_mode():
        model(torch.tensor(prefix), torch.arange(len(prefix)), cache)
        return model(torch.tensor(tokens), positions, cache, mask)


def one_token_passes(model, prefix: list[int], path_tokens: list[int]) -> torch.Tensor:
    """The logits after each of `path_tokens`, fed one per pass after `prefix`: [len, vocab]."""
    cache = model.new_cache(len(prefix) + len(path_tokens))
    rows = []
    with torch.inference_mode():
        model(torch.tensor(prefix), torch.arange(len(prefix)), cache)
        for offset, token in enumerate(path_tokens):
            rows.append(model(torch.tensor([token]), torch.tensor([len(prefix) + offset]), cache)[0])
    return torch.stack(rows)


def check_rows(model, rng: random.Random, sizes, vocab: int) -> int:
    """Checks chains and trees of each size; returns how many rows were compared."""
    compared = 0
    for size in sizes:
        for chain in (True, False):
            prefix = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            tokens = [rng.randrange(vocab) for _ in range(size)]
            parents = random_tree(rng, size, chain)
            together = tree_pass(model, prefix, tokens, parents)
            # One-token passes along each leaf's path give the rows of every node on it.
            node_paths = paths(parents)
            leaves = [path for node, path in enumerate(node_paths) if node not in parents]
            alone = {}
            for path in leaves:
                for node, row in zip(path, one_token_passes(model, prefix, [tokens[i] for i in path])):
                    alone.setdefault(node, row)
            assert sorted(alone) == list(range(size))
            for node in range(size):
                assert torch.equal(together[node], alone[node]), f"{'chain' if chain else 'tree'} of {size}, row {node}"
                compared += 1
    return compared


@pytest.mark.parametrize("tier", cpu_tier_params())
@pytest.mark.parametrize("quantization", FORMATS)
def test_every_row_of_a_pass_equals_its_one_token_pass(quantization, tier):
    model = kernel_model(quantization, tier=tier)
    rng = random.Random(quantization)
    compared = check_rows(model, rng, sizes=list(range(1, 33)), vocab=model.config.vocab_size)
    assert compared == 2 * sum(range(1, 33))


@pytest.mark.parametrize("tier", cpu_tier_params(portable=False))
@pytest.mark.parametrize("quantization", FORMATS)
def test_every_tier_gives_the_portable_tiers_logits(quantization, tier):
    """The same bits on every CPU: a pass over a tree in `tier` equals the portable tier's, row for
    row; for Gemma 3's shape too (sliding layers, q/k and sandwich norms, GeGLU)."""
    rng = random.Random(7)
    prefix, tokens = [rng.randrange(160) for _ in range(20)], [rng.randrange(160) for _ in range(9)]
    parents = random_tree(rng, 9, chain=False)
    for architecture in ("llama", "gemma3"):
        logits = tree_pass(kernel_model(quantization, tier=tier, architecture=architecture), prefix, tokens, parents)
        expected = tree_pass(kernel_model(quantization, tier="portable", architecture=architecture), prefix, tokens,
                             parents)
        assert torch.equal(logits, expected), architecture


@pytest.mark.parametrize("architecture", ["qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("quantization", FORMATS)
def test_every_architectures_rows_equal_their_one_token_passes(quantization, architecture):
    """Batch invariance for the architectures' differences, sliding windows (of 5 and 6 keys) under
    chains and trees deeper than the window included."""
    model = kernel_model(quantization, architecture=architecture)
    rng = random.Random(architecture)
    compared = check_rows(model, rng, sizes=[1, 2, 3, 7, 12, 20], vocab=model.config.vocab_size)
    assert compared == 2 * (1 + 2 + 3 + 7 + 12 + 20)


def test_rows_differ_between_paths_so_the_check_has_teeth():
    """Two different paths give different logits: equality above is not a constant model."""
    model = kernel_model("int4")
    a = one_token_passes(model, [1, 2, 3], [4, 5])
    b = one_token_passes(model, [1, 2, 3], [4, 6])
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "gguf", "int8", "none"])
def test_every_row_equals_its_one_token_pass_on_the_default_model(quantization):
    import specee

    model = specee.load(quantization=quantization).model
    assert model.layers[0].self_attn.kernels is not None
    rng = random.Random(quantization)
    check_rows(model, rng, sizes=[1, 2, 5, 9, 16, 32], vocab=model.config.vocab_size)


@pytest.mark.slow
def test_eager_fp32_decodes_the_compiled_tokens(default_engine):
    """`compile=False` (PyTorch's kernels) on dense fp32 weights: the compiled run's tokens. The
    quantized formats' eager path rounds activations to bf16 where the kernels take int8 blocks,
    so there its tokens are its own (lossless among themselves: test_quantized_model.py)."""
    import specee

    from test_speculative_lossless import PROMPTS

    eager = specee.load(quantization="none", compile=False)
    assert default_engine.model.uses_kernels and not eager.model.uses_kernels
    for prompt in (PROMPTS[0], PROMPTS[4]):  # one that copies, one that does not
        expected = default_engine.generate(prompt, max_tokens=64, ignore_eos=True, spec_method="none").token_ids
        assert eager.generate(prompt, max_tokens=64, ignore_eos=True).token_ids == expected, prompt


@pytest.mark.parametrize("architecture", list(TINY_ARCHITECTURES))
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_fused_layers_give_the_bits_of_the_layers_part_by_part(quantization, architecture):
    """On the integer formats a pass runs all its layers in one kernel call (`run_fused`); the same
    pass part by part (norm, matrices, attention, adds as separate calls) gives the same bits, for a
    chain, a tree, a chain of 2 rows, and a pass over some of the layers. The fused call runs on 3
    threads, each taking its own rows between the matmuls (7 rows: 3, 3 and 1; the 25-row prefix: runs
    of rows that see about as many keys each; 2 rows: fewer rows than threads, the attention's (row,
    head) items and the blocks of the block-wise steps split evenly). Heads of 16 (Llama, Qwen2,
    Mistral here) quantize their outputs after a barrier, heads of 32 within the attention step."""
    model = kernel_model(quantization, architecture=architecture)
    assert model.fused_stack is not None and all(layer.fused is not None for layer in model.layers)
    rng = random.Random(3)
    prefix, tokens = [rng.randrange(160) for _ in range(25)], [rng.randrange(160) for _ in range(7)]
    passes = [(tokens, random_tree(rng, 7, chain=True)), (tokens, random_tree(rng, 7, chain=False)),
              (tokens[:2], random_tree(rng, 2, chain=True))]
    with threads(3):
        fused = [tree_pass(model, prefix, *p) for p in passes]
        cache = model.new_cache(40)
        with torch.inference_mode():
            partial = model.hidden(torch.tensor(prefix), torch.arange(25), cache, layers=range(1, 3))
    stack = model.fused_stack
    model.fused_stack = None
    for layer in model.layers:
        layer.fused = None
    assert all(torch.equal(a, tree_pass(model, prefix, *p)) for a, p in zip(fused, passes))
    with torch.inference_mode():
        assert torch.equal(partial, model.hidden(torch.tensor(prefix), torch.arange(25), model.new_cache(40),
                                                 layers=range(1, 3)))
    assert stack is not None and not torch.equal(fused[0], fused[1])


def test_the_layers_call_times_each_step_on_every_thread_when_asked():
    """`Kernels.time_steps` (pass_profile.py's steps): each thread's time at work and waiting in each
    step of the layers' call, summed over layers and calls; nothing is timed unless asked."""
    model = kernel_model("int4")
    kernels = model.kernels
    ids = torch.tensor([5, 9, 3, 7, 1, 2, 8, 4, 6])
    with threads(3), torch.inference_mode():
        model.hidden(ids, torch.arange(9), model.new_cache(16))  # (warm-up)
        kernels.time_steps(True)
        start = time.perf_counter()
        for _ in range(4):
            model.hidden(ids, torch.arange(9), model.new_cache(16))
        wall = time.perf_counter() - start
        seconds, calls = kernels.step_seconds()
        kernels.time_steps(False)
        model.hidden(ids, torch.arange(9), model.new_cache(16))
        untimed, no_calls = kernels.step_seconds()
    assert calls == 4 and no_calls == 0 and untimed.numel() == 0
    assert kernels.layer_steps[1] == "qkv" and kernels.layer_steps[-1] == "residual"
    assert seconds.shape == (3, len(kernels.layer_steps), 2) and bool((seconds >= 0).all())
    assert bool((seconds[:, -1, 1] == 0).all())  # the last step ends in no barrier
    # Every thread worked on the matrices, and no thread's steps add up to more than the calls took.
    assert bool((seconds[:, kernels.layer_steps.index("gate_up"), 0] > 0).all())
    assert bool((seconds.sum(dim=(1, 2)) <= wall).all())
