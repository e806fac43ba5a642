"""The acceptance rules on their own: greedy keeps the target's argmax chain, and speculative
(rejection) sampling emits tokens distributed exactly as the target's, whatever the draft.

The sampling tests simulate a tiny "language model" whose next-token logits depend only on the
previous token (a Markov chain over V = 5 tokens): the target has logits L0 at the start and
LT[t] after token t; the draft has its own D0 / DT. Each sample drafts K tokens from the draft
chain, feeds the target logits of every drafted prefix to `acceptance.rejection`, and reads the
first two generated tokens; when the first round emits only one token, a second round starts
from it, exactly as the engine does. The pair must be distributed as P0(a) * PT[a, b].
Rows are independent samples (one key draws [N, ...] uniforms and categoricals), N = 200k,
all seeded: the checks are deterministic and their tolerances leave a wide margin.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec.engine import acceptance
from jspec.engine.sampling import Sampling, argmax, probabilities

V = 5
N = 200_000
P_MIN = 1e-3  # chi-square p-value below which a distribution is declared different


# -- greedy --------------------------------------------------------------------------------------

def logits_choosing(choice, vocab: int = 8) -> jnp.ndarray:
    """Logits [B, T, V] whose argmax at [b, t] is choice[b][t] (the others random, clearly lower)."""
    choice = np.asarray(choice)
    noise = np.random.default_rng(0).normal(size=(*choice.shape, vocab))
    logits = noise - 10.0
    np.put_along_axis(logits, choice[..., None], 5.0, axis=-1)
    return jnp.asarray(logits, jnp.float32)


def test_greedy_accepts_the_matching_prefix():
    target = [[1, 2, 3, 4],  # every draft matches: all 3 kept, then the bonus token 4
              [1, 5, 3, 4],  # mismatch at slot 1: keep 1 draft, emit the target's 5
              [6, 2, 3, 4],  # mismatch at slot 0: nothing kept; later matches do not count
              [1, 2, 3, 4],  # n_draft = 2: only two slots are proposed, the third is ignored
              [1, 2, 3, 4],  # n_draft = 0: no draft at all, the target's token at position 0
              [1, 2, 7, 4]]  # n_draft = 2 and slot 2 would mismatch anyway
    draft = jnp.asarray([[1, 2, 3]] * 6, jnp.int32)
    n_draft = jnp.asarray([3, 3, 3, 2, 0, 2], jnp.int32)
    n_acc, nxt = acceptance.greedy(draft, n_draft, logits_choosing(target))
    assert n_acc.tolist() == [3, 1, 0, 2, 0, 2]
    assert nxt.tolist() == [4, 5, 6, 3, 1, 7]
    assert n_acc.dtype == jnp.int32 and nxt.dtype == jnp.int32


def test_greedy_garbage_past_n_draft_is_ignored():
    """Slots past n_draft hold whatever the drafter left there; they never extend acceptance."""
    target = [[1, 2, 3, 4, 5]]
    n_acc, nxt = acceptance.greedy(jnp.asarray([[1, 2, 3, 4]], jnp.int32), jnp.asarray([1], jnp.int32),
                                   logits_choosing(target))
    assert (n_acc.tolist(), nxt.tolist()) == ([1], [2])


def test_greedy_without_draft_is_argmax():
    """K = 0 (autoregressive decoding): the target's argmax, nothing accepted."""
    logits = logits_choosing([[3], [0], [7]])
    n_acc, nxt = acceptance.greedy(jnp.zeros((3, 0), jnp.int32), jnp.zeros((3,), jnp.int32), logits)
    assert n_acc.tolist() == [0, 0, 0] and nxt.tolist() == [3, 0, 7]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_is_jnp_argmax(dtype):
    """sampling.argmax (a max, then the first index holding it) picks what jnp.argmax picks: the
    first of tied maxima (ties are common in bfloat16 and among -inf-masked logits), whole -inf
    rows, signed zeros, over a vocabulary-sized axis and in any leading shape."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 49_152)).astype(np.float32)
    x[0, 0, [7, 1000, 40_000]] = 9.0  # tied maxima: the first wins
    x[0, 1] = -np.inf
    x[0, 2, :] = 0.0
    x[0, 2, 5] = -0.0
    x[1] = np.round(x[1])  # many ties
    x = jnp.asarray(x, dtype)
    got = argmax(x)
    assert got.dtype == jnp.int32 and got.shape == (3, 4)
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    assert got[0, 0] == 7

# -- speculative sampling: distribution checks ---------------------------------------------------

def assert_distribution(counts: np.ndarray, probs: np.ndarray, tol: float = 0.005):
    """counts (of any shape) are draws from probs (same shape, sums to 1): zero-probability cells
    are never drawn, every cell is within `tol` of its probability, and a chi-square test
    (cells with fewer than 5 expected draws pooled) does not reject."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    total = counts.sum()
    assert total > 0 and probs.sum() == pytest.approx(1.0, abs=1e-5)
    assert counts[probs <= 1e-9].sum() == 0, "drew a token the target gives no probability"
    assert np.max(np.abs(counts / total - probs)) < tol, (counts / total, probs)
    expected = probs * total
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # too little pooled mass to test on its own: fold it into the largest cell
        obs[np.argmax(exp[:-1])] += obs[-1]
        exp[np.argmax(exp[:-1])] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) > 1:
        pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
        assert pvalue > P_MIN, f"chi-square p-value {pvalue:.2e}: observed {obs}, expected {exp}"


def chain(seed: int, scale: float = 1.5):
    """Start logits [V] and transition logits [V, V] of a random Markov chain."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(V,)) * scale, jnp.float32),
            jnp.asarray(rng.normal(size=(V, V)) * scale, jnp.float32))


TARGET = chain(0)
DRAFT = chain(1)  # an unrelated draft: many rejections
CLOSE = (TARGET[0] + 0.5 * chain(2)[0], TARGET[1] + 0.5 * chain(2)[1])  # a draft close to the target


def draft_round(key, prev, k: int, draft, sampling: Sampling, deterministic: bool):
    """Draft k tokens after `prev` ([N] tokens, -1 for the start of the text).

    Returns draft tokens [N, k], their distributions q [N, k, V] (None if deterministic: then
    each token is the draft chain's argmax, a fixed function of the prefix, like n-gram lookup)
    and the target logits fed to acceptance [N, k+1, V]."""
    d0, dt = draft
    t0, tt = TARGET
    n = prev.shape[0]
    tokens, probs = [], []
    target = [jnp.where((prev < 0)[:, None], t0, tt[jnp.maximum(prev, 0)])]
    x = prev
    for j, kj in enumerate(jax.random.split(key, k)):
        logits = jnp.where((x < 0)[:, None], d0, dt[jnp.maximum(x, 0)])
        q = probabilities(logits, sampling)
        if deterministic:
            x = jnp.argmax(q, axis=-1).astype(jnp.int32)
        else:
            x = jax.random.categorical(kj, jnp.log(q), axis=-1).astype(jnp.int32)
        tokens.append(x)
        probs.append(q)
        target.append(tt[x])
    tokens = jnp.stack(tokens, 1) if k else jnp.zeros((n, 0), jnp.int32)
    q = None if deterministic else (jnp.stack(probs, 1) if k else jnp.zeros((n, 0, V)))
    return tokens, q, jnp.stack(target, 1)


@functools.partial(jax.jit, static_argnames=("k", "sampling", "deterministic"))
def first_two_tokens(key, draft, random_n, *, k: int, sampling: Sampling, deterministic: bool):
    """N independent samples of the first two generated tokens; also the first round's n_accepted.

    random_n (a traced bool, so both settings share one compile): each row proposes a random
    number 0..k of its drafted tokens (as an adaptive controller would); otherwise all k."""
    keys = jax.random.split(key, 6)

    def one_round(keys, prev):
        tokens, q, target = draft_round(keys[0], prev, k, draft, sampling, deterministic)
        n_draft = jnp.where(random_n, jax.random.randint(keys[1], (N,), 0, k + 1), k).astype(jnp.int32)
        n_acc, nxt = acceptance.rejection(tokens, q, n_draft, target, sampling, keys[2])
        emitted = jnp.concatenate([tokens, jnp.zeros((N, 1), jnp.int32)], 1).at[jnp.arange(N), n_acc].set(nxt)
        return n_acc, emitted

    n_acc, emitted = one_round(keys[:3], jnp.full((N,), -1, jnp.int32))
    first = emitted[:, 0]
    _, again = one_round(keys[3:], first)  # the next round, for rows whose first round emitted one token
    second = jnp.where(n_acc >= 1, emitted[:, 1] if k else 0, again[:, 0])
    return first, second, n_acc


def exact_pair(sampling: Sampling) -> np.ndarray:
    """P(first = a, second = b) = P0(a) PT[a, b] under the target, after the sampling filters."""
    p0 = np.asarray(probabilities(TARGET[0], sampling), np.float64)
    pt = np.asarray(probabilities(TARGET[1], sampling), np.float64)
    return p0[:, None] * pt


SAMPLINGS = {
    "t1": Sampling(1.0),
    "t1.5-topk2": Sampling(1.5, top_k=2),
    "t0.6-topp0.7": Sampling(0.6, top_p=0.7),
    "t0.8-topk4-topp0.8": Sampling(0.8, top_k=4, top_p=0.8),
}
# (K, sampling): each pair compiles one sampler per drafter kind, a few seconds each, so the
# filters are covered at one K each rather than the full product.
CASES = [(0, "t1"), (1, "t1"), (3, "t1"), (3, "t1.5-topk2"), (1, "t0.6-topp0.7"), (2, "t0.8-topk4-topp0.8")]


@pytest.mark.parametrize("draft_name, k, sampling_name",
                         [(d, k, s) for d in ("unrelated", "close", "deterministic") for k, s in CASES
                          if k or d == "unrelated"])  # K = 0 drafts nothing: one case is enough
def test_rejection_sampling_is_lossless(draft_name, k, sampling_name):
    """The first generated token, and the first two, are distributed as the target's, for a
    draft unrelated to the target, one close to it, and a deterministic one (q one-hot, as
    `draft_probs=None` means); K = 0 is plain sampling (the `ar` method)."""
    sampling = SAMPLINGS[sampling_name]
    draft = DRAFT if draft_name == "unrelated" else CLOSE
    first, second, n_acc = map(np.asarray, first_two_tokens(
        jax.random.key(zlib.crc32(f"{k}-{draft_name}-{sampling_name}".encode())), draft, jnp.bool_(False), k=k, sampling=sampling,
        deterministic=draft_name == "deterministic"))
    pair = exact_pair(sampling)
    assert_distribution(np.bincount(first, minlength=V), pair.sum(1))  # the first generated token
    assert_distribution(np.bincount(first * V + second, minlength=V * V), pair)  # and the first two
    if k == 0:
        assert n_acc.max() == 0
        return
    # Within one round: given that draft 0 was accepted, the second token (draft 1 or the
    # target's own token at position 1) follows the target's distribution given the fed prefix.
    if k >= 2:
        acc = n_acc >= 1
        joint = np.bincount(first[acc] * V + second[acc], minlength=V * V).reshape(V, V)
        pt = np.asarray(probabilities(TARGET[1], sampling))
        tested = 0
        for a in range(V):
            if joint[a].sum() >= 2000:
                assert_distribution(joint[a], pt[a], tol=0.03)
                tested += 1
        assert tested >= 1 or draft_name == "unrelated"
    # Not vacuous: drafts get rejected, and (for drafts near the target) accepted, whole too.
    assert np.mean(n_acc == 0) > 0.02
    if draft_name != "unrelated":
        assert np.mean(n_acc >= 1) > 0.05
        assert np.mean(n_acc == k) > 0.005


def test_rejection_with_adaptive_draft_lengths():
    """Rows proposing a random 0..K of their drafted tokens (as controllers do) stay lossless."""
    pair = exact_pair(Sampling(1.0))
    for det in (False, True):
        first, second, n_acc = map(np.asarray, first_two_tokens(
            jax.random.key(11 + det), CLOSE, jnp.bool_(True), k=3, sampling=Sampling(1.0), deterministic=det))
        assert_distribution(np.bincount(first, minlength=V), pair.sum(1))
        assert_distribution(np.bincount(first * V + second, minlength=V * V), pair)
        assert set(np.unique(n_acc)) == {0, 1, 2, 3}


def test_rejection_bookkeeping():
    """n_accepted counts a leading run within n_draft; a draft equal to the target is always
    accepted in full (p / q = 1), a draft of tokens the target never picks never is."""
    sampling = Sampling(1.0, top_k=2)
    logits = jnp.asarray([[[5.0, 4.0, -9.0, -9.0], [-9.0, 5.0, 4.0, -9.0], [-9.0, -9.0, 5.0, 4.0]]] * 4)
    p = probabilities(logits, sampling)
    same = jnp.asarray([[0, 1], [1, 2], [0, 1], [2, 3]], jnp.int32)
    n_draft = jnp.asarray([2, 2, 1, 2], jnp.int32)
    n_acc, nxt = acceptance.rejection(same, p[:, :2], n_draft, logits, sampling, jax.random.key(3))
    # rows 0, 1, 2: q == p so every proposed token is accepted; row 3 proposes a token p rules out
    assert n_acc.tolist()[:3] == [2, 2, 1]
    assert int(n_acc[3]) == 0 and int(nxt[3]) in (0, 1)  # residual of p0 minus q: inside p0's support
    assert int(nxt[2]) in (1, 2)  # the bonus after a full accept is drawn from p at position n_draft
    one_hot = acceptance.rejection(same, None, n_draft, logits, sampling, jax.random.key(4))[0]
    assert int(one_hot[3]) == 0 and (one_hot >= 0).all() and (one_hot <= n_draft).all()
