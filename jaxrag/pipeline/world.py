"""Stage `world` (embedded default only): the generated knowledge world -> `W/world/` (corpus,
datasets, tokenizer; `jaxrag.world`)."""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.world.generate import WorldConfig, generate_world, write_world


def generated_world(cfg: ConfigDict):
    """The embedded world (pure function of the config: cheap to regenerate in any stage)."""
    return generate_world(WorldConfig(**cfg.world.to_dict()))


def world_stage(cfg: ConfigDict, workdir: Path) -> Path:
    return write_world(generated_world(cfg), workdir / "world")
