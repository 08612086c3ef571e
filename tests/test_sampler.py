"""The sampler against the definitions it implements (softmax sampling, top-k/top-p/min-p cuts,
CTRL repetition penalty), by counting draws."""
import numpy as np
import pytest

from pyinfer.sampler import SamplingParams, apply_repeat_penalty, sample

ALL = dict(top_k=0, top_p=1.0, min_p=0.0)


def draws(logits, params, n=4000, seed=0):
    rng = np.random.default_rng(seed)
    return np.bincount([sample(logits, params, rng) for _ in range(n)], minlength=logits.size)


def test_greedy_is_argmax():
    rng = np.random.default_rng(1)
    for _ in range(20):
        z = rng.normal(size=50).astype(np.float32)
        assert sample(z, SamplingParams(temperature=0), rng) == int(np.argmax(z))


def test_seeded_draws_are_reproducible():
    z = np.random.default_rng(2).normal(size=100).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    assert list(draws(z, p, 200, seed=7)) == list(draws(z, p, 200, seed=7))


def test_unfiltered_sampling_follows_softmax():
    z = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    for temp in (0.5, 1.0, 2.0):
        counts = draws(z, SamplingParams(temperature=temp, **ALL), n=20000)
        p = np.exp(z / temp) / np.exp(z / temp).sum()
        assert np.allclose(counts / counts.sum(), p, atol=0.015)


def test_top_k_keeps_only_k_best():
    z = np.arange(10, dtype=np.float32)
    counts = draws(z, SamplingParams(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0))
    assert counts[:7].sum() == 0 and (counts[7:] > 0).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    z = np.log(p).astype(np.float32)
    counts = draws(z, SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0))
    assert counts[2:].sum() == 0  # 0.5 + 0.3 reaches 0.8
    assert np.isclose(counts[0] / counts.sum(), 0.5 / 0.8, atol=0.03)


def test_min_p_cuts_relative_to_best():
    p = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    z = np.log(p).astype(np.float32)
    counts = draws(z, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert counts[3:].sum() == 0 and (counts[:3] > 0).all()  # 0.2 * 0.4 = 0.08 cuts 0.06, 0.04


def test_repeat_penalty_is_ctrl_rule():
    z = np.array([2.0, -2.0, 1.0], np.float32)
    out = apply_repeat_penalty(z, [0, 1, 1], 2.0)
    assert list(out) == [1.0, -4.0, 1.0] and list(z) == [2.0, -2.0, 1.0]
    z = np.array([1.0, 1.1], np.float32)
    assert sample(z, SamplingParams(temperature=0, repeat_penalty=1.5), None, recent=[1]) == 0


@pytest.mark.parametrize("bad", [dict(repeat_penalty=0), dict(top_p=0), dict(min_p=1.5)])
def test_bad_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
