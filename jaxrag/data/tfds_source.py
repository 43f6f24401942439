"""Datasets kept as TFDS builds (`--config.data.paths.NAME=tfds:BUILDER/CONFIG[:split]`, the
build's data dir, a folder or a bucket, in `data.tfds_data_dir`), as TPU VM users keep them.

Read with TFDS's data source: random access to the build's ArrayRecord (or Parquet) files, which
needs neither TensorFlow nor the network. A build in TFRecord files (`tfds build`'s default) is
refused with the command that converts it. Each row comes back in the layout of the dataset's Hub release
(text as str, `ClassLabel` values as their names: ai2_arc's `answerKey: "B"`), so the dataset's
own converter (`jaxrag.data.formats`) reads it: TriviaQA `unfiltered.nocontext`,
`natural_questions_open`, `ai2_arc/ARC-Challenge`, `ai2_arc/ARC-Easy` and `openbookqa` are the
builds TFDS publishes of the paper's datasets.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxrag.errors import JaxragError

PREFIX = "tfds:"
_SPEC = re.compile(r"tfds:(?P<builder>[\w.-]+(?:/[\w.-]+)?)(?::(?P<split>[\w.\[\]%:-]+))?")


def is_tfds(path: str | Path) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(path: str, default_split: str) -> tuple[str, str]:
    """`tfds:BUILDER/CONFIG[:split]` -> ("BUILDER/CONFIG", split); the paper's split by default."""
    m = _SPEC.fullmatch(path)
    if not m:
        raise JaxragError(f"{path!r}: expected tfds:BUILDER[/CONFIG][:split], e.g. "
                          "tfds:trivia_qa/unfiltered.nocontext:validation")
    return m["builder"], m["split"] or default_split


def tfds_rows(path: str, default_split: str, data_dir: str) -> tuple[str, Iterator[tuple[int, Any]]]:
    """(source name for errors, numbered rows) of a TFDS build's split."""
    name, split = parse(path, default_split)
    source = f"tfds:{name}:{split} ({data_dir or 'no data dir'})"
    if not data_dir:
        raise JaxragError(f"{source}: data.tfds_data_dir is empty; set --config.data.tfds_data_dir="
                          "DIR (the folder or bucket holding the TFDS builds)")
    # lazy: tensorflow_datasets: only TFDS sources need it (about a second to import)
    import tensorflow_datasets as tfds

    build = f"tfds build {name} --data_dir={data_dir} --file_format=array_record"
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise JaxragError(f"{source}: TFDS has no builder {name.split('/')[0]!r}") from None
    except ValueError as e:  # e.g. an unknown config
        raise JaxragError(f"{source}: {e}".replace("\n", " ")) from None
    if not builder.is_prepared():
        raise JaxragError(f"{source}: no build of {name} in {data_dir}; build it there with: {build}")
    try:
        builder.info.splits[split]  # a name, or a slice of one ("train[:10%]")
    except (KeyError, ValueError):
        raise JaxragError(f"{source}: the build has no split {split!r} (it has {', '.join(builder.info.splits)})") \
            from None
    try:
        data = builder.as_data_source(split=split)
    except NotImplementedError:  # the build's files are TFRecord: no random access
        raise JaxragError(
            f"{source}: the build is in TFRecord files; jaxrag reads ArrayRecord or Parquet builds (no "
            f"TensorFlow needed). Convert it once: tfds convert_format --root_data_dir={data_dir} "
            f"--out_file_format=array_record, or build it again: {build}") from None
    features = data.dataset_info.features
    return source, ((i + 1, _plain(data[i], features)) for i in range(len(data)))


def _plain(value: Any, feature: Any) -> Any:
    """A decoded TFDS example -> the Hub release's layout: bytes -> str, arrays -> lists,
    `ClassLabel` ints -> their names, `Sequence` of a dict -> a dict of lists."""
    # lazy: tensorflow_datasets: imported by tfds_rows already, only TFDS sources need it
    import tensorflow_datasets as tfds

    if isinstance(feature, tfds.features.FeaturesDict):
        return {k: _plain(value[k], feature[k]) for k in feature.keys() if k in value}
    if isinstance(feature, tfds.features.Sequence):
        return _plain(value, feature.feature) if isinstance(value, dict) else \
            [_plain(v, feature.feature) for v in value]
    if isinstance(feature, tfds.features.ClassLabel):
        return feature.int2str(int(value)) if not hasattr(value, "__len__") else \
            [feature.int2str(int(v)) for v in value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list):
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in value]
    return value
