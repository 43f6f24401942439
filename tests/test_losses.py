"""Each loss equals a direct numpy computation of its paper equation on a toy batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fixtures import tiny_model, toy_record, toy_records

from jaxrag.models.tokens import EOK, source_token
from jaxrag.prompts import answer_prefix_ids
from jaxrag.train import losses
from jaxrag.train.batches import RecordData, as_records

RNG = np.random.default_rng(0)


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_logsigmoid(x):
    return -np.log1p(np.exp(-x))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def featurize(model, records, pairs=False, epoch=0):
    data = RecordData(as_records(records, model.sources), model.tokenizer, 48, 2.0, seed=0, pairs=pairs)
    idx = np.array([*range(len(records)), -1])  # plus one padding row
    return data.rows(idx, epoch)


def np_segments(model, ids, mask):
    """Segments located from the token ids alone: (<s> position, knowledge span incl. <EOK>,
    answer span), independent of the featurizer's masks."""
    tok = model.tokenizer
    sources = {tok.convert_tokens_to_ids(source_token(s)): s for s in model.sources}
    n = mask.sum()
    s_pos = next(i for i, t in enumerate(ids[:n]) if t in sources)
    eok = list(ids).index(tok.convert_tokens_to_ids(EOK))
    ans0 = eok + len(answer_prefix_ids(tok))
    return sources[ids[s_pos]], s_pos, (s_pos + 1, eok + 1), (ans0, n)


def np_sequence_lp(logits, ids, positions):
    lp = np_log_softmax(logits.astype(np.float64))
    return sum(lp[t - 1, ids[t]] for t in positions)


def stage1_from_logits(logits, batch):
    return losses.stage1_loss(losses.token_logprobs(logits, batch["ids"]), batch)


def stage2_from_logits(logits_c, logits_r, batch, beta):
    lp_c, lp_r = losses.token_logprobs(logits_c, batch["ids"]), losses.token_logprobs(logits_r, batch["rej_ids"])
    return losses.stage2_loss(lp_c, lp_r, batch, beta)


def test_lm_loss_matches_numpy():
    logits = RNG.normal(size=(2, 7, 11)).astype(np.float32)
    ids = RNG.integers(0, 11, size=(2, 7))
    mask = (RNG.random((2, 7)) < 0.8).astype(np.float32)
    terms = jax.jit(lambda x, i, m: losses.lm_loss(losses.token_logprobs(x, i), m))(
        jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(mask))
    lp = np_log_softmax(logits.astype(np.float64))
    nll = [-lp[b, t - 1, ids[b, t]] for b in range(2) for t in range(1, 7) if mask[b, t]]
    np.testing.assert_allclose(terms.total / terms.count, np.mean(nll), rtol=1e-5)
    assert terms.count == mask[:, 1:].sum()


def test_stage1_loss_matches_equations(model):
    records = toy_records(5)  # labels: self, wiki, wiki, self, wiki
    batch = featurize(model, records)
    logits = RNG.normal(size=(*batch["ids"].shape, model.config.padded_vocab_size)).astype(np.float32)
    terms = jax.jit(stage1_from_logits)(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in batch.items()})
    src = verb = ans = 0.0
    for b in range(len(records)):
        ids = batch["ids"][b]
        label, s_pos, (k0, k1), (a0, a1) = np_segments(model, ids, batch["mask"][b])
        assert label == records[b]["label"]
        src -= np_sequence_lp(logits[b], ids, [s_pos])  # Eq. 1
        if label == "self":  # Eq. 2: c_i+ and the <EOK> that ends it
            verb -= np_sequence_lp(logits[b], ids, range(k0, k1))
        ans -= np_sequence_lp(logits[b], ids, range(a0, a1))  # Eq. 3
    n = len(records)
    np.testing.assert_allclose(terms.count, n)
    for name, ref in (("src", src), ("verb", verb), ("ans", ans)):
        np.testing.assert_allclose(terms.parts[name] / n, ref / n, rtol=1e-5)
    np.testing.assert_allclose(terms.total / n, (src + verb + ans) / n, rtol=1e-5)  # Eq. 4


def test_verbalization_loss_is_exactly_zero_for_wiki(model):
    batch = featurize(model, [toy_record(i, "wiki") for i in range(4)])
    assert not batch["verb"].any()
    logits = jnp.asarray(RNG.normal(size=(*batch["ids"].shape, model.config.padded_vocab_size)), jnp.float32)
    terms = jax.jit(stage1_from_logits)(logits, {k: jnp.asarray(v) for k, v in batch.items()})
    assert float(terms.parts["verb"]) == 0.0 and float(terms.parts["ans"]) > 0


def test_dpo_loss_matches_numpy():
    pc, pr, rc, rr = (RNG.normal(size=6) * 5 for _ in range(4))
    got = losses.dpo_loss(*(jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)), beta=0.3)
    ref = -np_logsigmoid(0.3 * ((pc - rc) - (pr - rr)))
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_stage2_loss_matches_equations(model):
    records = toy_records(5)
    batch = featurize(model, records, pairs=True)
    batch["ref_chosen"][:5] = RNG.normal(size=5) * 3 - 20
    batch["ref_rejected"][:5] = RNG.normal(size=5) * 3 - 20
    v = model.config.padded_vocab_size
    lc = RNG.normal(size=(*batch["ids"].shape, v)).astype(np.float32)
    lr = RNG.normal(size=(*batch["ids"].shape, v)).astype(np.float32)
    beta = 0.3
    terms = jax.jit(stage2_from_logits, static_argnums=3)(jnp.asarray(lc), jnp.asarray(lr),
                                                         {k: jnp.asarray(x) for k, x in batch.items()}, beta)
    src = dpo = ans = 0.0
    for b, rec in enumerate(records):
        ids, rej = batch["ids"][b], batch["rej_ids"][b]
        label, s_pos, (k0, k1), (a0, a1) = np_segments(model, ids, batch["mask"][b])
        src -= np_sequence_lp(lc[b], ids, [s_pos])
        ans -= np_sequence_lp(lc[b], ids, range(a0, a1))
        if label == "self":  # Eq. 6 on (c_i+, c_i-)
            _, _, (r0, r1), _ = np_segments(model, rej, batch["rej_mask"][b])
            assert model.tokenizer.decode(rej[r0:r1 - 1]).strip() == rec["contexts"][rec["worst"]["self"]]["text"]
            margin = (np_sequence_lp(lc[b], ids, range(k0, k1)) - batch["ref_chosen"][b]) \
                - (np_sequence_lp(lr[b], rej, range(r0, r1)) - batch["ref_rejected"][b])
            dpo -= np_logsigmoid(beta * margin)
    n = len(records)
    for name, ref in (("src", src), ("verb_dpo", dpo), ("ans", ans)):
        np.testing.assert_allclose(terms.parts[name] / n, ref / n, rtol=1e-5)
    np.testing.assert_allclose(terms.total / n, (src + dpo + ans) / n, rtol=1e-5)  # Eq. 5


def dpo_part(logits_c, logits_r, batch, beta):
    return stage2_from_logits(logits_c, logits_r, batch, beta).parts["verb_dpo"]


dpo_grads = jax.jit(jax.grad(dpo_part, argnums=(0, 1)))  # beta traced: one compilation


def test_dpo_gradient_vanishes_at_the_reference(model):
    """Policy = reference: margin 0, loss log 2 per Self pair, and the gradient is
    -beta/2 * d(margin) (numpy), so it vanishes as beta -> 0; identical pairs give exactly 0."""
    batch = featurize(model, [toy_record(0, "self"), toy_record(3, "self")], pairs=True)
    v = model.config.padded_vocab_size
    lc = RNG.normal(size=(*batch["ids"].shape, v)).astype(np.float32)
    lr = RNG.normal(size=(*batch["ids"].shape, v)).astype(np.float32)
    jb = {k: jnp.asarray(x) for k, x in batch.items()}
    seq_lp = jax.jit(lambda logits, ids, m: losses.sequence_logprob(losses.token_logprobs(logits, ids), m))
    lp_c, lp_r = seq_lp(jnp.asarray(lc), jb["ids"], jb["verb"]), seq_lp(jnp.asarray(lr), jb["rej_ids"], jb["rej_verb"])
    jb["ref_chosen"], jb["ref_rejected"] = lp_c, lp_r  # the reference is the policy itself
    np.testing.assert_allclose(jax.jit(dpo_part)(jnp.asarray(lc), jnp.asarray(lr), jb, 0.3), 2 * np.log(2), rtol=1e-6)

    def np_grad_margin(logits, ids, verb):  # d sum_t verb_t log p(ids_t) / d logits
        p = np.exp(np_log_softmax(logits.astype(np.float64)))
        g = np.zeros_like(p)
        for b, t in zip(*np.nonzero(verb)):
            g[b, t - 1] = -p[b, t - 1]
            g[b, t - 1, ids[b, t]] += 1
        return g

    for beta in (0.3, 1e-3, 0.0):
        gc, gr = dpo_grads(jnp.asarray(lc), jnp.asarray(lr), jb, beta)
        np.testing.assert_allclose(gc, -beta / 2 * np_grad_margin(lc, batch["ids"], batch["verb"]), atol=1e-7)
        np.testing.assert_allclose(gr, beta / 2 * np_grad_margin(lr, batch["rej_ids"], batch["rej_verb"]), atol=1e-7)
        assert np.abs(gc).max() <= beta * 0.5 + 1e-9
    same = dict(jb, rej_ids=jb["ids"], rej_mask=jb["mask"], rej_verb=jb["verb"], ref_rejected=lp_c)
    gc, gr = dpo_grads(jnp.asarray(lc), jnp.asarray(lc), same, 0.3)
    assert float(jnp.abs(gc + gr).max()) == 0.0


def test_pack_documents_keeps_every_document_whole_and_fills_rows():
    from jaxrag.train.batches import pack_documents

    rng = np.random.default_rng(0)
    docs = [list(range(1000 * i, 1000 * i + n)) for i, n in enumerate(rng.integers(5, 120, 300))]
    docs.append(list(range(900_000, 900_300)))  # longer than a row: split into 128 + 128 + 44
    masks = [[bool(t % 3) for t in d] for d in docs]  # a loss mask that travels with its tokens
    packed, loss, segments = pack_documents(list(zip(docs, masks)), 128, np.random.default_rng(1))
    tokens = packed[packed >= 0]
    assert sorted(tokens.tolist()) == sorted(t for d in docs for t in d)  # each once, nothing lost
    np.testing.assert_array_equal(loss, (packed >= 0) & (packed % 3 != 0))
    np.testing.assert_array_equal(segments > 0, packed >= 0)
    for doc in docs[:-1]:  # whole and contiguous within one row, one segment id of its own
        row, col = np.argwhere(packed == doc[0])[0]
        assert packed[row, col:col + len(doc)].tolist() == doc
        seg = segments[row, col]
        assert np.flatnonzero(segments[row] == seg).tolist() == list(range(col, col + len(doc)))
    greedy_rows, used = 1, 0  # in-order greedy packing, for comparison
    for n in [len(d[i:i + 128]) for d in docs for i in range(0, len(d), 128)]:
        greedy_rows, used = (greedy_rows, used + n) if used + n <= 128 else (greedy_rows + 1, n)
    assert len(packed) < 0.9 * greedy_rows and tokens.size / packed.size > 0.95


def test_text_data_scores_only_the_completion_of_instruction_documents(tiny_hf):
    from jaxrag.train.batches import TextData

    tok = tiny_hf("qwen2")[2].tokenizer
    docs = ["plain text is scored everywhere", ("Question: who? Answer:", " Ada"),
            ("Question: what? Answer:", " gold", "\nQuestion: where? Answer:", " Leeds")]
    data = TextData(docs, tok, 64, seed=0)
    batch = data.rows(np.arange(len(data.epoch_rows(0))), 0)
    scored = [int(t) for t, m in zip(batch["ids"].ravel(), batch["loss_mask"].ravel()) if m]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    want = tok(docs[0])["input_ids"] + eos + 2 * eos + sum(
        (tok(t, add_special_tokens=False)["input_ids"] for t in (" Ada", " gold", " Leeds")), [])
    assert sorted(scored) == sorted(want)
    assert sum(batch["mask"].ravel() > 0) == len(tok(docs[0])["input_ids"]) + 3 * len(eos) + sum(
        len(tok(p, add_special_tokens=False)["input_ids"]) for d in docs[1:] for p in d) + 2 * len(
        tok("")["input_ids"])


def test_packed_documents_see_only_themselves(tiny_hf):
    """A packed row's token log-probs equal transformers' on each document run alone from
    position 0 (no cross-document attention, positions restart at every document); with
    `targets`, the head runs at those positions only and gives the same values there, 0 elsewhere."""
    import torch

    from jaxrag.train.trainer import forward_fn

    ref, _, model = tiny_hf("qwen2")
    docs = [[5, 9, 13, 2], [7, 7, 30, 41, 8, 3, 2], [11, 2]]
    ids = np.array([sum(docs, []) + [0, 0]])
    segments = np.array([[k + 1 for k, d in enumerate(docs) for _ in d] + [0, 0]], np.int32)
    graphdef, params = nnx.split(model.decoder)
    forward = forward_fn(graphdef, params)
    packed = np.asarray(forward(jnp.asarray(ids), jnp.asarray(segments)))
    start = 0
    for doc in docs:
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([doc])).logits[0], -1).numpy()
        np.testing.assert_allclose(packed[0, start + 1:start + len(doc)],
                                   want[np.arange(len(doc) - 1), doc[1:]], atol=1e-4)
        start += len(doc)
    targets = np.array([[3, 5, 6, 12, 0, 0]], np.int32)  # 0 = unused slot
    at = np.asarray(forward(jnp.asarray(ids), jnp.asarray(segments), jnp.asarray(targets)))
    on = np.zeros_like(at, bool)
    on[0, [3, 5, 6, 12]] = True
    np.testing.assert_allclose(at[on], packed[on], atol=1e-5)
    assert not at[~on].any()


def test_targets_are_every_loss_position(model):
    """`targets` lists exactly the rows' src / verb / ans positions (rejected: rej_verb's too)."""
    batch = featurize(model, toy_records(5), pairs=True)
    for key, masks in (("targets", ("src", "verb", "ans")), ("rej_targets", ("rej_verb",))):
        for b in range(len(batch["ids"])):
            listed = {int(t) for t in batch[key][b] if t > 0}
            wanted = {int(t) for m in masks for t in np.flatnonzero(batch[m][b])}
            assert wanted <= listed
            if key == "targets":
                assert listed == wanted
