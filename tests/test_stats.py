"""Speculative statistics on hand-computed passes."""
import pytest

from specee.stats import GenerationStats


def test_acceptance_statistics_by_hand():
    stats = GenerationStats()
    stats.record_pass(proposed=3, accepted=3)  # all accepted
    stats.record_pass(proposed=3, accepted=1)  # position 2 rejected
    stats.record_pass(proposed=2, accepted=0)  # position 1 rejected
    stats.record_pass(proposed=0, accepted=0)  # nothing drafted
    assert stats.target_passes == 4
    assert stats.accept_lengths == [4, 2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(2.0)
    assert stats.draft_tokens_proposed == 8 and stats.draft_tokens_accepted == 4
    # position 1: accepted in 2 of the 3 passes that drafted it
    # position 2: reached (position 1 accepted) in 2 passes, accepted in 1
    # position 3: reached in 1 pass (the second pass stopped before it), accepted there
    assert stats.per_position_acceptance == pytest.approx([2 / 3, 1 / 2, 1.0])
    # CTAR(w): among passes drafting >= w tokens, the share with the first w all accepted
    assert stats.ctar(1) == pytest.approx(2 / 3)
    assert stats.ctar(2) == pytest.approx(1 / 3)
    assert stats.ctar(3) == pytest.approx(1 / 2)
    assert stats.ctar(4) == 0.0


def test_decode_speed_counts_tokens_after_the_first():
    stats = GenerationStats(generated_tokens=11, decode_s=2.0)
    assert stats.tokens_per_s == pytest.approx(5.0)
