"""The RoPE angle table: the angles each pass computed before, read from rows."""
import torch

from helpers import specee_from_hf, tiny_hf_model
from specee.model.rope import ANGLE_TABLE_START, AngleTable, rope_angles


def frequencies(head_dim: int, bases: tuple[float, ...]) -> torch.Tensor:
    return torch.stack([1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim) for base in bases])


def test_the_table_gives_each_pass_the_angles_it_would_compute():
    """Chains, a tree's unsorted positions, one position alone, and positions past the table's end
    (it grows): bit for bit what rope_angles gives for the same positions, for one set of
    frequencies and for two (Gemma 3's sliding layers)."""
    generator = torch.Generator().manual_seed(0)
    for inv_freq in (frequencies(64, (10000.0,)), frequencies(32, (1e6, 1e4))):
        table = AngleTable(inv_freq, torch.float32)
        starts = [0, 5, 300, ANGLE_TABLE_START - 3, 3 * ANGLE_TABLE_START + 7, 40]
        for start in starts:
            for positions in (torch.arange(start, start + 9), torch.tensor([start]),
                              start + torch.randint(0, 5, (12,), generator=generator)):
                got, want = table.angles(positions), rope_angles(inv_freq, positions, torch.float32)
                assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)
        assert table.length >= 3 * ANGLE_TABLE_START + 16


def test_the_model_rebuilds_its_table_when_its_frequencies_change():
    model = specee_from_hf(tiny_hf_model(seed=1, intermediate_size=128), pack=False)
    positions = torch.tensor([3, 4, 5])
    first = model.angles(positions)
    model.inv_freq = model.inv_freq * 0.5  # a loader sets new frequencies
    second = model.angles(positions)
    want = rope_angles(model.inv_freq, positions, model.dtype)
    assert torch.equal(second.cos, want.cos) and not torch.equal(first.cos, second.cos)
