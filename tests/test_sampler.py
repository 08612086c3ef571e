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


@pytest.mark.parametrize("temp", [1e-320, 1e-300, 1e-40])
def test_a_vanishing_temperature_is_greedy(temp):
    """A temperature the option check accepts but whose logit / temperature overflows (1e-320
    is a float64 subnormal) draws the argmax, the limit of the softmax, instead of NaN
    probabilities (a server request with it answered 500 before session 31)."""
    rng = np.random.default_rng(5)
    for _ in range(10):
        z = (rng.normal(size=300) * 4).astype(np.float32)
        assert sample(z, SamplingParams(temperature=temp), rng) == int(np.argmax(z))


@pytest.mark.parametrize("penalty", [1e-300, 1e300, 1e-45])
def test_an_extreme_repeat_penalty_stays_finite(penalty):
    """A penalty whose f32 quotient overflows (or rounds to 0) saturates at the largest f32
    with the CTRL rule's sign, so sampling still works, without a floating-point warning."""
    import warnings

    z = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = apply_repeat_penalty(z, [0, 1], penalty)
        tok = sample(z, SamplingParams(temperature=0.8, repeat_penalty=penalty),
                     np.random.default_rng(0), recent=[0, 1])
    assert np.isfinite(out).all() and out[2] == 1.0 and out[3] == 0.5
    big = np.finfo(np.float32).max
    if penalty < 1:  # a seen positive logit grows, a seen negative one shrinks towards 0
        assert out[0] == big and -1e-30 < out[1] <= 0
    else:  # the reverse
        assert 0 <= out[0] < 1e-30 and out[1] == -big
    assert 0 <= tok < 4


@pytest.mark.parametrize("bad", [dict(repeat_penalty=0), dict(top_p=0), dict(min_p=1.5)])
def test_bad_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ---- the whole default chain against llama.cpp's definition, written out independently ---------
def reference_chain(z, temp, top_k, top_p, min_p):
    """llama.cpp's default chain over a full vocabulary, one filter at a time on plain Python
    lists (src/llama-sampling.cpp: top_k, then top_p and min_p on the softmax of the unscaled
    logits, then temperature and the final softmax). Returns {token id: probability}."""
    order = sorted(range(len(z)), key=lambda i: -float(z[i]))
    if top_k > 0:
        order = order[:top_k]
    ex = [np.exp(float(z[i]) - float(z[order[0]])) for i in order]
    probs = [e / sum(ex) for e in ex]
    cum, kept = 0.0, []
    for i, pr in zip(order, probs):  # top-p: stop once the mass reaches top_p
        kept.append((i, pr))
        cum += pr
        if cum >= top_p:
            break
    kept = [(i, pr) for i, pr in kept if pr >= min_p * kept[0][1]] or kept[:1]
    w = {i: np.exp((float(z[i]) - float(z[kept[0][0]])) / temp) for i, _ in kept}
    total = sum(w.values())
    return {i: v / total for i, v in w.items()}


@pytest.mark.parametrize("seed", range(6))
def test_default_chain_matches_the_reference(seed):
    from pyinfer.sampler import distribution

    rng = np.random.default_rng(seed)
    z = (rng.standard_normal(300) * rng.uniform(0.5, 4)).astype(np.float32)
    for params in (SamplingParams(), SamplingParams(temperature=1.3, top_k=5, top_p=0.8, min_p=0.1),
                   SamplingParams(temperature=0.5, top_k=0, top_p=0.9, min_p=0.0)):
        ids, p = distribution(z, params)
        ref = reference_chain(z, params.temperature, params.top_k, params.top_p, params.min_p)
        assert sorted(ids.tolist()) == sorted(ref)
        assert np.allclose(p, [ref[i] for i in ids.tolist()], rtol=1e-9, atol=1e-12)


def test_draws_follow_the_default_chain():
    from pyinfer.sampler import distribution

    z = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01]))
    z = np.concatenate([z, np.full(60, np.log(0.0001))]).astype(np.float32)
    ids, p = distribution(z, SamplingParams())
    counts = draws(z, SamplingParams(), n=20000)
    assert counts.sum() == counts[ids].sum()  # nothing outside the chain's cut is ever drawn
    assert np.allclose(counts[ids] / 20000, p, atol=0.015)


def test_defaults_are_llama_cpp_s():
    # llama.cpp common/common.h common_params_sampling: top_k 40, top_p 0.95, min_p 0.05, temp 0.80,
    # penalty_last_n 64, penalty_repeat 1.00 (off)
    assert SamplingParams() == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                              repeat_penalty=1.0, repeat_last_n=64)


def test_grammar_mask_is_applied_before_the_chain():
    from pyinfer.sampler import distribution

    z = np.array([5.0, 4.0, 1.0, 0.5, 0.0], np.float32)
    allowed = np.array([False, False, True, True, True])
    ids, p = distribution(z, SamplingParams(top_k=2), allowed=allowed)
    assert ids.tolist() == [2, 3]  # top-k counts only allowed tokens
    assert sample(z, SamplingParams(temperature=0), None, allowed=allowed) == 2
    from pyinfer.errors import PyinferError

    with pytest.raises(PyinferError, match="allows no token"):
        distribution(z, SamplingParams(), allowed=np.zeros(5, bool))
    # every allowed token banned (ignore_eos's -inf on the end a grammar needs): greedy took
    # token 0, outside the mask; sampling got NaN probabilities
    zb = z.copy()
    zb[2:] = -np.inf
    for temp in (0.0, 0.8):
        with pytest.raises(PyinferError, match="can be drawn"):
            distribution(zb, SamplingParams(temperature=temp), allowed=allowed)


def test_repeat_penalty_window_is_the_last_n_tokens():
    # llama.cpp penalizes the last penalty_last_n tokens; the engine passes self.tokens[-n:]
    z = np.array([1.1, 1.0], np.float32)
    params = SamplingParams(temperature=0, repeat_penalty=1.2, repeat_last_n=2)
    history = [1, 0, 0]  # token 1 fell out of a 2-token window: only token 0 is penalized
    assert sample(z, params, None, recent=history[-params.repeat_last_n:]) == 1  # 1.1/1.2 < 1.0
    assert sample(z, params, None, recent=history) == 0  # both penalized: 1.1/1.2 > 1.0/1.2


def test_minus_one_means_all_as_in_llama_cpp(smollm2_q8):
    """llama.cpp's --top-k -1 (any k <= 0 keeps every token) and --repeat-last-n -1 (the penalty
    over the whole context) were refused; -1 now works in the CLI, the API and the server."""
    from pyinfer import LLM
    from pyinfer.cli import main as run_main
    from pyinfer.engine import Engine
    from pyinfer.options import check

    assert check("top_k", -1) == -1 and check("repeat_last_n", -1) == -1
    z = np.arange(10, dtype=np.float32)
    counts = draws(z, SamplingParams(temperature=5.0, top_k=-1, top_p=1.0, min_p=0.0))
    assert (counts > 0).all()
    assert run_main([smollm2_q8, "-p", "hi", "-n", "2", "-t", "1", "-c", "64", "--top-k", "-1",
                     "--repeat-last-n", "-1", "--repeat-penalty", "1.3"]) == 0
    # the whole context: a prompt token further back than 64 is penalised, as with last_n = n_ctx
    eng = Engine(smollm2_q8, n_ctx=256, n_threads=1)
    prompt = eng.tokenizer.encode("The capital of France is Paris. " + "one two three four " * 20)
    outs = []
    for last_n in (-1, 256, 64):
        eng.reset()
        p = SamplingParams(temperature=0, repeat_penalty=50.0, repeat_last_n=last_n)
        outs.append(list(eng.generate(prompt, p, max_tokens=12, seed=0)))
    assert outs[0] == outs[1] and outs[0] != outs[2]
    llm = LLM(smollm2_q8, n_ctx=128, n_threads=1)
    for call in (llm.create_completion, llm.create_chat_completion):
        arg = "hi" if call == llm.create_completion else [{"role": "user", "content": "hi"}]
        assert call(arg, max_tokens=2, repeat_last_n=-1, top_k=-1)["usage"]["completion_tokens"] >= 1
