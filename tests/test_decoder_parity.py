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


@pytest.mark.parametrize("remat", ["none", "block", "dots"])
def test_scanned_layers_with_remat_equal_the_unrolled_math(remat):
    """Stage-1 loss and gradients of the scanned stack (under each remat policy) equal a plain
    Python loop over the layers, each applied with its own slice of the stacked weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from train_fixtures import tiny_model, toy_records

    from jaxrag.models.masks import attention_mask_4d, positions_from_segments
    from jaxrag.models.rope import rope_cos_sin
    from jaxrag.train import losses, trainer
    from jaxrag.train.batches import RecordData, as_records

    model = tiny_model()
    data = RecordData(as_records(toy_records(4), model.sources), model.tokenizer, 40, 0.0, seed=0)
    batch = {k: jnp.asarray(v) for k, v in data.rows(np.arange(4), 0).items()}
    graphdef, state = nnx.split(model.decoder)
    params = nnx.to_pure_dict(state)

    def unrolled(p, ids, mask, targets):
        dec = nnx.merge(graphdef, p)
        seg = mask.astype(jnp.int32)
        x = dec.embed[...][ids]
        cos, sin = rope_cos_sin(dec.cfg.rope, positions_from_segments(seg), x.dtype)
        att = attention_mask_4d(seg > 0, ids.shape[1], 0, None, seg)
        layer_graph, stacked = nnx.split(dec.layers)
        for i in range(dec.cfg.num_layers):
            block = nnx.merge(layer_graph, jax.tree.map(lambda w: w[i], stacked))
            x, _ = block(x, cos, sin, att, None, i, 0)
        x = jnp.take_along_axis(x, jnp.maximum(targets - 1, 0)[..., None], axis=1)
        logits = dec.final_norm(x) @ (dec.embed[...].T if dec.cfg.tie_word_embeddings else dec.lm_head[...])
        logits = jnp.where(jnp.arange(logits.shape[-1]) < dec.cfg.vocab_size, logits, -1e9)
        return losses.target_logprobs(logits, ids, targets)

    want_loss, want_grads = jax.value_and_grad(lambda p: losses.stage1_objective(
        lambda *a: unrolled(p, *a), batch).total)(params)
    terms, grads = jax.jit(lambda p: trainer.loss_and_grads(graphdef, losses.stage1_objective, p, batch, remat))(params)
    np.testing.assert_allclose(float(terms.total), float(want_loss), rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("n_in, x_shape, w_shape", [(1, (2, 3, 5), (5, 4, 6)), (2, (2, 3, 4, 6), (4, 6, 5))])
def test_projection_gradient_equals_jax_autodiff(n_in, x_shape, w_shape):
    """`project`'s own backward (dW = x^T g over the token dims) equals JAX's autodiff of the
    plain contraction, for an input projection ([e] -> [heads, head_dim]) and the output one."""
    import jax
    import jax.numpy as jnp

    from jaxrag.models.projection import project

    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    g = jax.random.normal(kg, x_shape[: len(x_shape) - n_in] + w_shape[n_in:])
    got_y, got_vjp = jax.vjp(lambda a, b: project(a, b, n_in), x, w)
    want_y, want_vjp = jax.vjp(lambda a, b: jnp.tensordot(a, b, axes=n_in), x, w)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-6)
    for got, want in zip(got_vjp(g), want_vjp(g)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
