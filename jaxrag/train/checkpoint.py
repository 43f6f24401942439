"""Orbax checkpoints of the train state: periodic async saves, keep the last N, resume from the
latest onto any mesh (the restore target carries the current mesh's shardings).

A checkpoint holds `state` (params, optimizer state, step; sharded arrays) and `meta` (JSON:
data position, running counters and the run's fingerprint). Orbax writes to a temp directory
and renames it when complete, so a run killed mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxrag.runtime import concurrency
from jaxrag.errors import JaxragError

class Checkpoints:
    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True,
                                               cleanup_tmp_directories=True)
        with concurrency.ORBAX:
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        with concurrency.ORBAX:
            return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Returns once the arrays are copied off the devices; files are written in the background
        (side by side with other pieces: before it returns, inside `concurrency.ORBAX`)."""
        with concurrency.ORBAX:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)
            if concurrency.side_by_side():
                self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """`abstract_state`: tree of jax.ShapeDtypeStruct with the target shardings."""
        try:
            with concurrency.ORBAX:
                out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                          meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise JaxragError(f"{self.directory / str(step)}: cannot restore this checkpoint into the current "
                              f"model/optimizer ({e}); use a fresh workdir") from None
        return out.state, dict(out.meta)

    def wait(self) -> None:
        with concurrency.ORBAX:
            self.manager.wait_until_finished()

    def close(self) -> None:
        with concurrency.ORBAX:
            self.manager.close()


def abstract_like(tree, shardings):
    """Arrays (or ShapeDtypeStructs) + matching NamedShardings -> restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
