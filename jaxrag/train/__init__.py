"""Training: pretraining, SR-RAG stage 1 and stage 2 (DPO), sharded over any mesh.

Public API (imported lazily, so `import jaxrag.train` stays cheap):
`train_lm`, `train_stage1`, `train_stage2` (jaxrag.train.stages); the losses
`lm_loss`, `stage1_loss`, `dpo_loss`, `stage2_loss` (jaxrag.train.losses).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "train_lm": "stages", "train_stage1": "stages", "train_stage2": "stages", "reference_logprobs": "stages",
    "lm_loss": "losses", "stage1_loss": "losses", "dpo_loss": "losses", "stage2_loss": "losses",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"jaxrag.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jaxrag.train' has no attribute {name!r}")
