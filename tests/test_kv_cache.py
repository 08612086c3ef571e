"""The KV cache's type (``-ctk/--cache-type``): f16 by default as llama.cpp's, f32 for f32 files
and on request; both run the same model, the f16 one storing numpy's rounding of the f32 one's
values, and a bad name is a one-line error."""
import numpy as np
import pytest

from pyinfer.engine import Engine
from pyinfer.kv_cache import cache_dtype
from tests._tiny_gguf import write_tiny_gguf
from tests.test_cli import assert_user_error, pyinfer_run

PROMPT = [5, 77, 31, 200, 9, 14, 150, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("kv") / "tiny.gguf"))


def test_cache_dtype_rule():
    assert cache_dtype("auto", True) is np.float32 and cache_dtype("auto", False) is np.float16
    assert cache_dtype("f32", False) is np.float32 and cache_dtype("f16", True) is np.float16
    with pytest.raises(ValueError, match="cache type"):
        cache_dtype("q8_0", False)


def test_f16_cache_holds_the_rounded_f32_values(tiny):
    """Prefill (numpy's astype) and decode (the kernels' F16C rounding) store the f16 values of
    what the f32 run stores, as long as both runs agree up to the rows being written: checked on
    the first layer, whose keys and values do not depend on the cache (later layers do)."""
    runs = {}
    for ct in ("f16", "f32"):
        eng = Engine(tiny, n_ctx=32, n_threads=2, cache_type=ct)
        assert eng.model.cache.dtype == np.dtype(np.float16 if ct == "f16" else np.float32)
        eng.eval_prompt(PROMPT[:5])
        logits = [eng.eval_token(t) for t in PROMPT[5:]]
        runs[ct] = (eng.model.cache.k[0, :len(PROMPT)].copy(), eng.model.cache.v[0, :len(PROMPT)].copy(),
                    np.stack(logits))
    (k16, v16, l16), (k32, v32, l32) = runs["f16"], runs["f32"]
    assert np.array_equal(k16.view(np.uint16), k32.astype(np.float16).view(np.uint16))
    assert np.array_equal(v16.view(np.uint16), v32.astype(np.float16).view(np.uint16))
    # the logits of the two caches: close (f16 rounding of keys and values, about 2^-11)
    assert np.abs(l16 - l32).max() < 2e-2 * np.abs(l32).max()


def test_bad_cache_type_is_a_user_error(tiny):
    assert_user_error(pyinfer_run(tiny, "-p", "x", "-ctk", "q9"), "cache-type")
    r = pyinfer_run(tiny, "-p", "ab", "-n", "3", "--temp", "0", "-ctk", "f32")
    assert r.returncode == 0, r.stderr
