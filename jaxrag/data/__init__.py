"""Datasets, corpora and the embedded world: the shared QA schema lives in `schema`."""

from jaxrag.data.schema import QAExample, read_examples, write_examples
from jaxrag.data.world import World, WorldConfig, generate_world, write_world

__all__ = [
    "QAExample", "World", "WorldConfig", "generate_world", "read_examples", "write_examples",
    "write_world",
]
