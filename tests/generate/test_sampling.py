"""Sampling: greedy, temperature, top-k, top-p, and per-prompt seeding."""

import numpy as np

from hpcinfer.generate.sampling import SamplingParams, filtered_probs, sample, sequence_rng

logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]], dtype=np.float32))


def test_greedy_is_argmax():
    batch = np.random.default_rng(1).standard_normal((4, 20)).astype(np.float32)
    assert sample(batch, SamplingParams(), [None] * 4).tolist() == batch.argmax(-1).tolist()


def test_top_k_keeps_the_k_most_likely():
    probs = filtered_probs(logits[0], SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(probs, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = filtered_probs(logits[0], SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(probs, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85, atol=1e-6)
    # a tiny top_p keeps only the most likely token
    assert filtered_probs(logits[0], SamplingParams(temperature=1.0, top_p=1e-6)).tolist() == [1, 0, 0, 0, 0]


def test_temperature_sharpens_and_flattens():
    sharp = filtered_probs(logits[0], SamplingParams(temperature=0.5))
    flat = filtered_probs(logits[0], SamplingParams(temperature=2.0))
    assert sharp[0] > 0.5 > flat[0]
    np.testing.assert_allclose(sharp, np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2 / np.sum(
        np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2), atol=1e-6)


def test_sampled_frequencies_follow_the_probabilities():
    params = SamplingParams(temperature=1.0)
    rng = sequence_rng(0, 0)
    draws = [int(sample(logits, params, [rng])[0]) for _ in range(4000)]
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)


def test_seeded_per_prompt_draws_are_reproducible_and_distinct():
    params = SamplingParams(temperature=1.0)
    draw = lambda seed, index: [int(sample(logits, params, [r])[0]) for r in [sequence_rng(seed, index)] * 50]
    assert draw(7, 3) == draw(7, 3)
    assert draw(7, 3) != draw(7, 4)
    assert draw(7, 3) != draw(8, 3)
