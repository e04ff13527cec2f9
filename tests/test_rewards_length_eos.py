"""Length similarity and termination shaping at their edges."""
from __future__ import annotations

import pytest

from rewards.eos import brevity_penalty, eos_component, eos_component_batch, eos_reward, is_terminated, overlong_penalty
from rewards.length import length_ratio, length_similarity, length_similarity_batch

EOS, PAD = 2, 0


@pytest.mark.parametrize(
    "pred, ref, expected",
    [
        ("Die Größe der Straße", "die größe der strasse", 1.0),
        ("eins zwei", "eins zwei drei vier", 0.5),
        ("eins zwei drei vier", "eins zwei", 0.5),  # symmetric
        ("", "eins zwei", 0.0),
        ("  ...  ", "eins", 0.0),  # no word tokens
        ("", "", 0.0),
        ("eins", "", 0.0),
        ("Größe", "Gr e", 0.5),  # counts Unicode words: Größe is one token
    ],
)
def test_length_similarity(pred, ref, expected):
    assert length_similarity(pred, ref) == pytest.approx(expected)


def test_length_ratio_bounds_and_batch():
    assert length_ratio(3, 7) == length_ratio(7, 3) == pytest.approx(3 / 7)
    assert length_ratio(0, 0) == 0.0
    preds, refs = ["a b", "a b c d", ""], ["a b c d"] * 3
    assert length_similarity_batch(preds, refs) == [0.5, 1.0, 0.0]
    with pytest.raises(ValueError):
        length_similarity_batch(["a"], ["a", "b"])


def test_is_terminated_follows_last_id():
    assert is_terminated([5, 6, EOS], [EOS])
    assert not is_terminated([5, EOS, 6], [EOS])
    assert not is_terminated([], [EOS])
    assert is_terminated([5, PAD], [EOS, PAD])  # TRL's rule when pad is passed too


def test_eos_reward_values():
    assert eos_reward([1, EOS], [EOS], 8) == 0.1
    assert eos_reward([1] * 8, [EOS], 8) == -0.1  # cut at the cap
    assert eos_reward([1] * 7, [EOS], 8) == 0.0  # neither (e.g. a stop string)
    assert eos_reward([1] * 7 + [EOS], [EOS], 8, eos_bonus=0.3) == 0.3  # EOS as the last allowed token
    assert eos_reward([1] * 8, [EOS], 8, truncation_penalty=0.5) == -0.5


@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (84, 0.0), (85, -1 / 16), (92, -0.5), (99, -15 / 16), (100, -1.0), (120, -1.0)],
)
def test_overlong_penalty_dapo(length, expected):
    # max_len 100, buffer 16: zero up to 84, then linear to -1 at 100
    assert overlong_penalty(length, 100, 16) == pytest.approx(expected)


def test_overlong_penalty_edges():
    assert overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off within the cap
    assert overlong_penalty(101, 100, 0) == -1.0
    assert overlong_penalty(5, 10, 50) == pytest.approx(-0.5)  # buffer wider than the cap ramps from 0


def test_pieces_take_ids_or_counts():
    assert overlong_penalty([1] * 92, 100, 16) == overlong_penalty(92, 100, 16) == pytest.approx(-0.5)
    assert brevity_penalty([1] * 16, 64) == brevity_penalty(16, 64) == -0.25


def test_brevity_penalty():
    assert brevity_penalty(0, 64) == 0.0
    assert brevity_penalty(32, 64) == -0.5
    assert brevity_penalty(64, 64) == -1.0


def test_eos_component_combines_and_tracks_current_cap():
    kw = dict(eos_bonus=0.1, truncation_penalty=0.1, overlong_buffer=4, overlong_weight=0.5, brevity_weight=0.2)
    # terminated early: bonus and brevity only
    assert eos_component([1, 1, 1, EOS], [EOS], 16, **kw) == pytest.approx(0.1 - 0.2 * 4 / 16)
    # cut at 16: penalty, full overlong, full brevity
    assert eos_component([1] * 16, [EOS], 16, **kw) == pytest.approx(-0.1 - 0.5 - 0.2)
    # terminated on the last allowed token: bonus but still inside the overlong ramp
    assert eos_component([1] * 15 + [EOS], [EOS], 16, **kw) == pytest.approx(0.1 - 0.5 - 0.2)
    # the same 16 ids under a raised cap are neither truncated nor overlong
    assert eos_component([1] * 16, [EOS], 64, **kw) == pytest.approx(-0.2 * 16 / 64)
    # defaults: +/-0.1, overlong weight 0.1 over a 16-token buffer, no brevity
    assert eos_component([1, EOS], [EOS], 64) == pytest.approx(0.1)
    assert eos_component([1] * 64, [EOS], 64) == pytest.approx(-0.2)
    with pytest.raises(ValueError):
        eos_component([1], [EOS], 0)


def test_eos_component_batch():
    ids = [[1, EOS], [1] * 8, [1, 1]]
    assert eos_component_batch(ids, [EOS], 8, overlong_weight=0.0) == [0.1, -0.1, 0.0]
