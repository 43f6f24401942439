"""Source-selection policies: one interface (`jaxrag.decode.policy`: `PolicyInputs` ->
`PolicyDecision`), so every method runs on the same decoding engine. Here: always-RAG and
always-verbalize (`always`), SR-RAG's p_M x p_D (`srrag`), and the selective-retrieval baselines
IK (`ik`), SeaKR (`seakr`) and CCSK (`ccsk`); `router_inputs` gives a policy its inputs without
decoding past `<EOQ>`.
"""

from __future__ import annotations

import numpy as np

from jaxrag.decode.policy import Policy, PolicyDecision, PolicyInputs, source_probabilities
from jaxrag.decode.sampler import prefill_last
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import source_token
from jaxrag.prompts import prompt_ids


def always(source: str) -> Policy:
    """Always-RAG (`wiki`) or always-verbalize (GenRead-style, `self`)."""

    def policy(inputs: PolicyInputs) -> PolicyDecision:
        if source not in inputs.sources:
            raise JaxragError(f"unknown source {source!r}; the model's sources are {list(inputs.sources)}")
        return PolicyDecision(np.full(len(inputs.questions), inputs.sources.index(source)))

    return policy


def router_inputs(model, questions: list[str], hidden_layer: int, batch_size: int = 32) -> PolicyInputs:
    """What `route()` hands a policy, without decoding anything after `<EOQ>`: one prefill of
    `Question: q Background knowledge:<EOQ>` per batch -> p_M (`source_probabilities`) and the
    hidden state of `hidden_layer` at `<EOQ>`. For choosing thresholds on validation questions."""
    if not questions:
        raise JaxragError("router_inputs: no questions")
    src_ids = [model.token_id(source_token(s)) for s in model.sources]
    p_model, hidden = [], []
    for n, state, h in prefill_last(model.decoder, prompt_ids(model.tokenizer, list(questions)), hidden_layer,
                                    batch_size):
        p_model.append(source_probabilities(state.logits[:n], src_ids))
        hidden.append(np.asarray(h[:n], np.float32))
    return PolicyInputs(list(questions), tuple(model.sources), np.concatenate(p_model), np.concatenate(hidden))
