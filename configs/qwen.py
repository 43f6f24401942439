"""Qwen2.5-7B-Instruct as in the SR-RAG paper; `configs/qwen.py:tiny` = the embedded CPU default."""

from jaxrag.pipeline.config import get_config_for


def get_config(arg=None):
    return get_config_for("qwen2", arg)
