"""The quality measure of lossy methods: NLL of an output under the full model, teacher-forced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY

from jspec.bench import quality
from jspec.errors import JspecError


def hf_token_nll(hf, prompt, output):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].double(), dim=-1).numpy()
    return np.array([-logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(output)])


def test_token_nll_equals_hf(tiny_llama):
    model = tiny_llama.jspec_model()
    rng = np.random.default_rng(0)
    prompt, output = rng.integers(0, TINY["vocab_size"], 11).tolist(), rng.integers(0, TINY["vocab_size"], 7).tolist()
    np.testing.assert_allclose(quality.token_nll(model, prompt, output), hf_token_nll(tiny_llama.hf, prompt, output),
                               atol=1e-4)


def test_mean_nll_weighs_tokens_not_rows(tiny_llama):
    model = tiny_llama.jspec_model()
    a, b = ([1, 2, 3], [4]), ([5, 6], [7, 8, 9, 10, 11])
    per_token = np.concatenate([quality.token_nll(model, *a), quality.token_nll(model, *b)])
    assert quality.mean_nll(model, [a, b]) == pytest.approx(per_token.mean(), rel=1e-6)


def test_out_of_vocabulary_is_refused(tiny_llama):
    with pytest.raises(JspecError, match="vocabulary"):
        quality.token_nll(tiny_llama.jspec_model(), [1, 2], [TINY["vocab_size"]])
