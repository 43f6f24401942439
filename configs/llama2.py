"""Llama-2-7B-chat as in the SR-RAG paper; `configs/llama2.py:tiny` = the embedded CPU default."""

from jaxrag.pipeline.config import get_config_for


def get_config(arg=None):
    return get_config_for("llama", arg)
