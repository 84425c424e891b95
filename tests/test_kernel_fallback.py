"""A CPU tier that cannot run never falls back silently: `cpu_kernels()` says on stderr which tier
failed, why, and which tier runs instead; and a tier whose library is built but refuses this process
(AMX, where Linux refuses the tile state) is unavailable with its own reason, not a damaged cache."""
from __future__ import annotations

import subprocess

import pytest

import specee.model.kernels as kernels_module
from specee.model.kernels import HERE, KernelsUnavailable, compiler, supported_tiers

REFUSING_TABLE = r"""
#include "api.h"
extern "C" __attribute__((visibility("default"))) const specee::KernelTable* specee_kernel_table_portable() {
  static const specee::KernelTable table{specee::KERNEL_API_VERSION, "portable", "no tile state for this test"};
  return &table;
}
"""


def failing_best_tier(monkeypatch, failing: str) -> None:
    """load_tier raises, as a failed build does, for `failing` alone."""
    real = kernels_module.load_tier

    def load_tier(name: str):
        if name == failing:
            raise KernelsUnavailable(f"building the {name} CPU kernels failed: error: no such flag")
        return real(name)

    monkeypatch.setattr(kernels_module, "load_tier", load_tier)


def test_the_best_tier_failing_falls_back_to_the_next_with_a_warning(monkeypatch, capsys):
    tiers = supported_tiers()
    if len(tiers) < 2:
        pytest.skip(f"this CPU runs {tiers[0]} alone: there is no tier to fall back to")
    monkeypatch.delenv("SPECEE_CPU_TIER", raising=False)
    failing_best_tier(monkeypatch, tiers[0])
    kernels = kernels_module.cpu_kernels.__wrapped__()  # not the process's cached choice
    assert kernels is not None and kernels.tier == tiers[1]
    err = capsys.readouterr().err
    assert (f"specee: warning: the {tiers[0]} CPU tier is unavailable (building the {tiers[0]} CPU kernels failed: "
            f"error: no such flag); falling back to the {tiers[1]} tier") in err
    assert f"CPU kernels: {tiers[1]} (" in err


def test_a_tier_asked_for_by_name_that_fails_says_there_is_no_fallback(monkeypatch, capsys):
    monkeypatch.setenv("SPECEE_CPU_TIER", "portable")
    failing_best_tier(monkeypatch, "portable")
    assert kernels_module.cpu_kernels.__wrapped__() is None
    err = capsys.readouterr().err
    assert "the portable CPU tier is unavailable (" in err and "no other tier to fall back to" in err
    assert "running the eager path" in err


def test_a_built_tier_that_refuses_this_process_is_unavailable_with_its_reason(monkeypatch, tmp_path):
    """A library whose table says `unavailable`: KernelsUnavailable with the table's reason (so
    cpu_kernels falls back), never the damaged-cache path that rebuilds and tries again."""
    source, library = tmp_path / "refusing.cpp", tmp_path / "librefusing.so"
    source.write_text(REFUSING_TABLE)
    done = subprocess.run([compiler(), "-std=c++17", "-shared", "-fPIC", f"-I{HERE}", str(source), "-o", str(library)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    builds = []
    monkeypatch.setattr(kernels_module, "tier_library", lambda tier: builds.append(tier.name) or library)
    with pytest.raises(KernelsUnavailable, match="the portable CPU kernels cannot run here: no tile state for this test"):
        kernels_module.load_tier.__wrapped__("portable")
    assert builds == ["portable"]  # opened once, not rebuilt as a damaged library would be
    assert library.exists()
