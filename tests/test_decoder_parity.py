"""The Flax decoder against transformers (PyTorch, CPU) on random tiny checkpoints."""

import numpy as np
import pytest
import torch

from hf_fixtures import VARIANTS

SEQ = 24  # longer than the LongRoPE variant's original context (16)


@pytest.fixture(params=sorted(VARIANTS))
def pair(request, tiny_hf):
    ref, _, model = tiny_hf(request.param)
    return ref, model


def _batch(vocab, padding):
    ids = np.random.RandomState(1).randint(3, vocab, (3, SEQ))
    mask = np.ones_like(ids)
    if padding == "left":
        mask[1, :7], mask[2, :3] = 0, 0
    elif padding == "right":
        mask[1, -7:], mask[2, -3:] = 0, 0
    ids = np.where(mask == 1, ids, 1)  # pad id
    return ids, mask


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_and_hidden_states_match_transformers(pair, padding):
    ref, model = pair
    ids, mask = _batch(model.config.vocab_size, padding)
    with torch.no_grad():
        out = ref(torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
    real = mask.astype(bool)
    logits = np.asarray(model.logits(ids, mask))
    assert logits.shape == (3, SEQ, ref.config.vocab_size)
    np.testing.assert_allclose(logits[real], out.logits.numpy()[real], atol=1e-4)
    for layer in (0, 1, 2, 3):
        hidden = np.asarray(model.hidden_states(ids, layer, mask))
        np.testing.assert_allclose(hidden[real], out.hidden_states[layer].numpy()[real], atol=1e-4)


def test_hidden_layer_out_of_range_is_refused(pair):
    _, model = pair
    with pytest.raises(ValueError, match="outside"):
        model.hidden_states(np.zeros((1, 4), int), model.config.num_layers + 1)
