"""jaxrag: Self-Routing RAG (SR-RAG) and selective-retrieval baselines in JAX/Flax.

Public API: `jaxrag.load_model(path)` -> `Model` with `.logits(ids)`, `.hidden_states(ids, layer)`
and `.tokenizer`. Heavy modules load on first use so CLIs start fast.
"""

from jaxrag.errors import JaxragError

__all__ = ["JaxragError", "Model", "load_model", "save_model", "export_hf", "add_special_tokens"]


def __getattr__(name):
    if name in ("Model", "load_model", "save_model", "export_hf", "add_special_tokens"):
        from jaxrag.models import model  # jax and transformers load on first use: `import jaxrag` stays instant

        return getattr(model, name)
    raise AttributeError(f"module 'jaxrag' has no attribute {name!r}")
