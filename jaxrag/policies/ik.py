"""IK ("I Know", Déjean 2024, arXiv:2412.11536): a classifier, trained on judge
labels "the untuned model answers this question correctly closed-book", reads the question plus
the model's first 32 generated answer tokens and predicts P(know); retrieve iff P(know) < threshold.

Scaled to what runs here: the paper fine-tunes an LLM as the Yes/No classifier; we keep the LLM
frozen and fit a logistic-regression probe on its hidden state at the last token of
`Question: q Answer: <32 greedy tokens>`. In a causal decoder that is the only position that has
read the question and the whole answer prefix, i.e. where a fine-tuned classifier would read its
Yes/No logit. The layer defaults to the middle of the stack: knowledge-awareness is most
linearly readable mid-depth (SR-RAG's own datastore key is a middle layer for the same reason).

The closed-book helpers (`closed_book_samples`, `last_token_states`, `retrieve_sources`) are
shared with SeaKR and CCSK, which also look at what the model says without retrieval.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import jax
import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from jaxrag.decode.policy import Policy, PolicyDecision, PolicyInputs
from jaxrag.decode.sampler import SamplingParams, generate_samples, prefill_last
from jaxrag.errors import JaxragError
from jaxrag.models.model import Model
from jaxrag.prompts import base_prompt_ids, base_prompt_text

IK_ANSWER_TOKENS = 32  # the paper: 32 (or 64) generated tokens are "helpful enough"
RETRIEVE = "wiki"
GREEDY = SamplingParams()


# ---------------------------------------------------------------------------------------------
# Closed-book generation and hidden states (shared by IK, SeaKR, CCSK)
# ---------------------------------------------------------------------------------------------

def closed_book_prompts(model: Model, questions: Sequence[str]) -> list[list[int]]:
    """The untuned model's closed-book prompt `Question: q Answer:` as token ids."""
    return base_prompt_ids(model.tokenizer, [base_prompt_text(q) for q in questions])


def default_stop_ids(model: Model) -> list[int]:
    eos = model.tokenizer.eos_token_id
    return [] if eos is None else [eos]


def closed_book_samples(model: Model, questions: Sequence[str], max_new_tokens: int, *, samples: int = 1,
                        sampling: SamplingParams = GREEDY, rng: jax.Array | None = None,
                        stop_ids: Sequence[int] | None = None, max_rows: int = 128,
                        layer: int | None = None) -> tuple[list[list[list[int]]], np.ndarray | None]:
    """`samples` continuations of each question's closed-book prompt -> ([question][sample] token
    ids, stop token kept, as `generate` returns them; with `layer`, the hidden state after that
    decoder layer at each one's last token [questions, samples, hidden], read as the decode loop
    writes it, else None). Each prompt is prefilled once for all its samples
    (`sampler.generate_samples`); one call holds at most `max_rows` rows (questions x samples).
    Sample j of question q draws with its own key (`sampling.row_keys`, from q's text and j), so it
    is the same in any batch of questions and on any device."""
    prompts = closed_book_prompts(model, questions)
    stops = default_stop_ids(model) if stop_ids is None else list(stop_ids)
    rng = jax.random.key(0) if rng is None else rng
    per_call = 1 << (max(1, max_rows // samples).bit_length() - 1)  # padded to a power of two: <= max_rows rows
    out: list[list[list[int]]] = []
    states = []
    for start in range(0, len(prompts), per_call):
        ids = [zlib.crc32(f"{q}\x00{j}".encode()) for q in questions[start:start + per_call] for j in range(samples)]
        gens, hidden = generate_samples(model.decoder, prompts[start:start + per_call], max_new_tokens, samples=samples,
                                        stop_ids=stops, sampling=sampling, rng=rng, row_ids=ids, hidden_layer=layer)
        out += gens
        states.append(hidden)
    return out, (None if layer is None else np.concatenate(states))


def closed_book_generations(model: Model, questions: Sequence[str], max_new_tokens: int, *, samples: int = 1,
                            sampling: SamplingParams = GREEDY, rng: jax.Array | None = None,
                            stop_ids: Sequence[int] | None = None, max_rows: int = 128) -> list[list[list[int]]]:
    """`closed_book_samples`' token ids alone: [question][sample]."""
    return closed_book_samples(model, questions, max_new_tokens, samples=samples, sampling=sampling, rng=rng,
                               stop_ids=stop_ids, max_rows=max_rows)[0]


def last_token_states(model: Model, sequences: Sequence[Sequence[int]], layer: int,
                      max_rows: int = 64) -> np.ndarray:
    """Hidden state after decoder layer `layer` (transformers' `hidden_states[layer]`) at each
    sequence's last token -> float32 [n, hidden]. One left-padded prefill per chunk, as routing
    reads `<EOQ>`: the last column is every row's last token, and only that column's state and
    logits leave the device. Shapes are bucketed, so a run compiles a few programs."""
    if any(len(s) == 0 for s in sequences):
        raise JaxragError("last_token_states: empty sequence")
    states = [np.asarray(hidden[:n], np.float32) for n, _, hidden in
              prefill_last(model.decoder, sequences, layer, max_rows)]
    return np.concatenate(states) if states else np.empty((0, model.config.hidden_size), np.float32)


def middle_layer(model: Model) -> int:
    """L/2 in transformers' hidden_states indexing (16 of 32 for Llama-2-7B)."""
    return max(1, model.config.num_layers // 2)


def retrieve_sources(retrieve: np.ndarray, sources: tuple[str, ...]) -> np.ndarray:
    """Boolean "retrieve" per row -> source index: `wiki`, else the model's other source."""
    if len(sources) != 2 or RETRIEVE not in sources:
        raise JaxragError(f"retrieve-or-not policies need two sources including {RETRIEVE!r}, got {list(sources)}")
    wiki = sources.index(RETRIEVE)
    return np.where(np.asarray(retrieve, bool), wiki, 1 - wiki)


# ---------------------------------------------------------------------------------------------
# IK
# ---------------------------------------------------------------------------------------------

def ik_features(model: Model, questions: Sequence[str], *, layer: int | None = None,
                answer_tokens: int = IK_ANSWER_TOKENS, max_rows: int = 64) -> np.ndarray:
    """Question + its first `answer_tokens` greedy closed-book tokens -> the frozen model's
    hidden state at the last token, [n, hidden]."""
    layer = middle_layer(model) if layer is None else layer
    _, states = closed_book_samples(model, questions, answer_tokens, max_rows=max_rows, layer=layer)
    return states[:, 0]


@dataclasses.dataclass
class IKClassifier:
    """A fitted IK probe and the feature settings it was fitted with."""

    classifier: Pipeline  # StandardScaler -> LogisticRegression; class 1 = "knows"
    layer: int
    answer_tokens: int = IK_ANSWER_TOKENS

    def p_know(self, features: np.ndarray) -> np.ndarray:
        """[n, hidden] -> P(the model answers correctly closed-book) [n]."""
        know = list(self.classifier.classes_).index(1)
        return self.classifier.predict_proba(features)[:, know]


def fit_ik_features(features: np.ndarray, knows: np.ndarray, *, layer: int,
                    answer_tokens: int = IK_ANSWER_TOKENS, c: float = 1.0, seed: int = 0) -> IKClassifier:
    """Logistic regression on standardised features. No class re-weighting: P(know) stays
    calibrated, so a threshold on it keeps its meaning (the harness picks it on validation)."""
    knows = np.asarray(knows).astype(int)
    if set(np.unique(knows)) != {0, 1}:
        raise JaxragError("fit_ik: the judge labels need both outcomes (0 = wrong, 1 = correct closed-book)")
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000, random_state=seed))
    clf.fit(np.asarray(features, np.float64), knows)
    return IKClassifier(clf, layer, answer_tokens)


def fit_ik(model: Model, questions: Sequence[str], knows: np.ndarray, *, layer: int | None = None,
           answer_tokens: int = IK_ANSWER_TOKENS, c: float = 1.0) -> IKClassifier:
    """Judge labels (1 = the untuned model answers correctly closed-book) -> fitted IK probe."""
    layer = middle_layer(model) if layer is None else layer
    feats = ik_features(model, questions, layer=layer, answer_tokens=answer_tokens)
    return fit_ik_features(feats, knows, layer=layer, answer_tokens=answer_tokens, c=c)


def ik_know_probability(model: Model, ik: IKClassifier, questions: Sequence[str]) -> np.ndarray:
    """P(know) [n] for new questions (features as at fitting)."""
    return ik.p_know(ik_features(model, questions, layer=ik.layer, answer_tokens=ik.answer_tokens))


def ik_scores(model: Model, ik: IKClassifier, questions: Sequence[str]) -> np.ndarray:
    """1 - P(know) [n]: higher = more reason to retrieve (the harness sweeps thresholds on it)."""
    return 1.0 - ik_know_probability(model, ik, questions)


def ik_policy(model: Model, ik: IKClassifier, threshold: float = 0.5) -> Policy:
    """Retrieve iff P(know) < threshold. `score` = 1 - P(know)."""

    def policy(inputs: PolicyInputs) -> PolicyDecision:
        p_know = ik_know_probability(model, ik, inputs.questions)
        return PolicyDecision(retrieve_sources(p_know < threshold, inputs.sources), score=1.0 - p_know)

    return policy
