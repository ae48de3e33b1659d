"""meshgrad.rules: the same numbers from numpy, torch and jax.numpy."""

import numpy as np
import pytest

from meshgrad import rules

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

BACKENDS = [(np, np.asarray), (torch, torch.tensor), (jnp, jnp.asarray)]


@pytest.mark.parametrize("xp, make", BACKENDS)
def test_expert_bias_sign_update_with_sign_zero(xp, make):
    bias = make(np.array([[0.5, 0, 0, 0], [0, 0, 0, 1]], np.float32))
    tokens = make(np.array([[1, 2, 3, 2], [0, 0, 0, 4]], np.float32))  # means 2 and 1
    out = np.asarray(rules.expert_bias_update(bias, tokens, 0.25, xp))
    np.testing.assert_array_equal(out, [[0.75, 0, -0.25, 0], [0.25, 0.25, 0.25, 0.75]])
    assert out.dtype == np.float32


@pytest.mark.parametrize("xp, make", BACKENDS)
def test_qb_local_and_update(xp, make):
    local = rules.qb_local(make(np.array([2, 4, 6], np.float32)), make(np.array(0, np.float32)), xp)
    np.testing.assert_array_equal(np.asarray(local), [2, 4, 6])  # count 0 divides by 1
    local = rules.qb_local(make(np.array([2, 4, 6], np.float32)), make(np.array(2, np.float32)), xp)
    np.testing.assert_array_equal(np.asarray(local), [1, 2, 3])
    new = rules.qb_beta_update(make(np.array([1, 1, 4], np.float32)), local, 0.5)
    np.testing.assert_array_equal(np.asarray(new), [-1, -0.5, 1.5])  # [1, 1.5, 3.5] - 2


@pytest.mark.parametrize("xp, make", BACKENDS)
def test_token_scale_is_one_over_max_n_1(xp, make):
    np.testing.assert_array_equal(np.asarray(rules.token_scale(make(np.array(0.0, np.float32)), xp)), 1.0)
    np.testing.assert_array_equal(np.asarray(rules.token_scale(make(np.array(8.0, np.float32)), xp)), 0.125)
