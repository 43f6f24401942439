"""Phi-3.5-mini-instruct as in the SR-RAG paper; `configs/phi3.py:tiny` = the embedded CPU default."""

from jaxrag.pipeline.config import get_config_for


def get_config(arg=None):
    return get_config_for("phi3", arg)
