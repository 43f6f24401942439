"""The seeds' selectors (IK, SeaKR, CCSK), fitted on training questions with their own papers'
decision rules, for the eval stage (`jaxrag.pipeline.eval.fit_selectors` fits them).

- IK: logistic probe on the untuned model's question + first answer tokens, judge label "answers
  correctly closed-book"; retrieve iff P(know) < 0.5 (score 1 - P(know)). IK's judge gives a
  binary Yes/No per answer; with the paper's string metrics as the judge, "correct" is a pass mark
  per metric (`IK_KNOWS_CUT`, `knows`): the binary metrics' own 1, and at least half on the graded
  ones (token F1 on Wizard of Wikipedia; ASQA's STR-EM, the share of its disambiguated answers
  named). A graded score above 0 is not knowing: one shared token, or one of several answers, is
  partial at best. The cuts are fixed, not tuned, and label training questions only.
- SeaKR: uncertainty U(q) from sampled generations; its paper searches the threshold "on a small
  subset of the training set": the cut that best agrees with the training labels (retrieval
  preferred, from the construct stage) on `SEAKR_FIT_QUESTIONS` stratified training questions.
- CCSK: query kNN + response-quality model + fusion, trained on the labelled training questions,
  deciding with its paper's published taus.
The training sample (`baselines.max_train_questions`) is stratified over the training datasets.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from ml_collections import ConfigDict

from jaxrag.decode.policy import PolicyDecision, PolicyInputs
from jaxrag.eval.metrics import metric_name, score_prediction
from jaxrag.policies import ccsk as ccsk_mod
from jaxrag.policies import ik as ik_mod
from jaxrag.policies import seakr as seakr_mod

SEAKR_FIT_QUESTIONS = 200  # "a small subset of the training set"
IK_P_KNOW = 0.5  # retrieve iff the probe's P(know) is below one half
# IK's judge label "answers correctly": the pass mark per metric (binary metrics: 1 = correct).
IK_KNOWS_CUT = {"match": 1.0, "true_false": 1.0, "choice": 1.0, "f1": 0.5, "str_em": 0.5}


def knows(dataset: str, prediction: str, example) -> bool:
    """IK's judge label for one closed-book answer: its score reaches its metric's pass mark."""
    return score_prediction(dataset, prediction, example) >= IK_KNOWS_CUT[metric_name(dataset)]


@dataclasses.dataclass
class SeedSelectors:
    cfg: ConfigDict
    base: object  # the untuned Model whose knowledge the selectors judge
    encoder: object
    train_items: list  # every training question (counted in the report)
    train: list  # the stratified sample they are fitted on
    ik: object | None  # IKClassifier, or None when the judge labels have one class
    ik_constant: bool  # with one class: retrieve always (True) or never
    seakr_threshold: float
    ccsk: object

    def score_policy(self, rule: str):
        """threshold t -> a Policy retrieving iff its score > t."""
        b, max_new = self.cfg.baselines, int(self.cfg.inference.max_answer_tokens)
        if rule == "ik" and self.ik is not None:
            return lambda t: ik_mod.ik_policy(self.base, self.ik, 1.0 - t)  # P(know) < 1 - t
        if rule == "ik":
            return lambda t: constant_score_policy(float(self.ik_constant), t)
        if rule == "seakr":
            return lambda t: seakr_mod.seakr_policy(self.base, t, samples=int(b.seakr_samples), max_new_tokens=max_new)
        raise ValueError(f"no thresholded selector {rule!r}")

    def paper_threshold(self, rule: str) -> float:
        return {"ik": 1.0 - IK_P_KNOW, "seakr": self.seakr_threshold}[rule]

    def ccsk_policy(self):
        return ccsk_mod.ccsk_policy(self.base, self.encoder, self.ccsk)

    def fixed_thresholds(self) -> dict:
        """The thresholds no protocol tunes, for `config.thresholds`."""
        return {"ik_p_know": IK_P_KNOW, "ik_knows_cut": dict(IK_KNOWS_CUT), "seakr_fitted_on_training": self.seakr_threshold,
                "ccsk": {"tau_pred": ccsk_mod.TAU_PRED, "tau_conf": ccsk_mod.TAU_CONF,
                         "tau_single": ccsk_mod.TAU_SINGLE}}


def constant_score_policy(score: float, t: float):
    """A selector with one answer for every question (IK when its judge saw one class)."""
    def policy(inputs: PolicyInputs) -> PolicyDecision:
        s = np.full(len(inputs.questions), score)
        return PolicyDecision(ik_mod.retrieve_sources(s > t, inputs.sources), score=s)
    return policy
