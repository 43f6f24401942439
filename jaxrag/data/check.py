"""A real-model config's datasets, checked before any stage runs (`pipeline.preflight`).

Every dataset in `data.train` and `data.eval` is loaded, each row validated (`data.loaders`), so
a bad file stops the run before `base` and `index` are paid for. Each training dataset must hold
the mixture's counts (App. B.1, Table 5): its `data.validation_sizes.NAME` questions in full and
`data.train_sizes.NAME` more, drawn without overlap (`mixture.mixture_split`). The public train
splits hold Table 5's counts with room to spare (NQ-open 87,925 >= 15,529; KILT FEVER 104,966 >=
9,965; KILT WoW 63,734 >= 17,361; OpenBookQA 4,957 >= 4,696; ARC-Easy 2,251 >= 2,144; ASQA 4,353
>= 3,894), so the full files give Table 5 exactly; a smaller file is an error naming the counts
to lower, never a silently different mixture.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from jaxrag.data.loaders import DATASETS, left_out, load_dataset_examples
from jaxrag.data.schema import QAExample
from jaxrag.errors import JaxragError


def dataset_examples(cfg: ConfigDict, name: str) -> list[QAExample]:
    """Dataset `name` whole, at the paper's split (TriviaQA: the unfiltered validation split,
    Self-RAG's test set): the file or TFDS build `data.paths.NAME`, or the Hugging Face Hub when
    that is empty."""
    return load_dataset_examples(name, cfg.data.paths.get(name) or None, tfds_data_dir=cfg.data.tfds_data_dir)


def rows_left_out(cfg: ConfigDict, names) -> dict[str, dict[str, int]]:
    """Per dataset, its rows left out on purpose, per reason (`loaders.left_out`): the data
    summary of a run on real data (PubHealth's unlabeled rows, PopQA's popular entities, ...)."""
    return {name: counts for name in names
            if (counts := left_out(name, cfg.data.paths.get(name) or None, tfds_data_dir=cfg.data.tfds_data_dir))}


def check_data(cfg: ConfigDict) -> None:
    """Loads and validates every configured dataset of a real-model config (`model.path` set; the
    embedded world generates its own), and checks the training files against the mixture's
    counts. Raises one JaxragError line naming the dataset, file and setting at fault."""
    if not cfg.model.path:
        return
    for section in ("train", "eval"):
        for name in cfg.data[section]:
            if name not in DATASETS:
                raise JaxragError(f"data.{section}: unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    sizes = {name: (_count(cfg, "validation_sizes", name), _count(cfg, "train_sizes", name))
             for name in cfg.data.train}
    if not sum(train for _, train in sizes.values()):
        raise JaxragError(f"data.train={list(cfg.data.train)} with data.train_sizes "
                          f"{ {n: t for n, (_, t) in sizes.items()} }: no training question to "
                          "construct from; name a training dataset and a train size above 0")
    short, fixes = [], []
    for name, (n_val, n_train) in sizes.items():
        n = len(dataset_examples(cfg, name))
        if n < n_val + n_train:
            spec = DATASETS[name]
            source = cfg.data.paths.get(name) or f"{spec.hub}[{spec.split}]"
            short.append(f"{name}: {source} has {n} usable questions, fewer than "
                         f"data.validation_sizes.{name}={n_val} + data.train_sizes.{name}={n_train}")
            fit_val, fit_train = fit_counts(n, n_val, n_train)
            fixes.append(f"--config.data.validation_sizes.{name}={fit_val} "
                         f"--config.data.train_sizes.{name}={fit_train}")
    if short:
        raise JaxragError("training mixture larger than its files (Table 5's counts need the full "
                          f"public train splits): {'; '.join(short)}. Give the full files, or lower "
                          f"the counts to fit, e.g. {' '.join(fixes)}")
    for name in cfg.data.eval:
        dataset_examples(cfg, name)


def fit_counts(n: int, n_val: int, n_train: int) -> tuple[int, int]:
    """(validation, train) counts that fit `n` questions, in Table 5's proportion; at least one
    validation question when any was asked and one remains to train on."""
    fit_val = min(n_val, round(n * n_val / (n_val + n_train)))
    if n_val and not fit_val and n > 1:
        fit_val = 1
    return fit_val, min(n_train, n - fit_val)


def _count(cfg: ConfigDict, field: str, name: str) -> int:
    value = cfg.data[field].get(name)
    if value is None:
        raise JaxragError(f"data.{field}.{name}: missing for training dataset {name!r}; set "
                          f"--config.data.{field}.{name}=N")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JaxragError(f"data.{field}.{name}={value!r}: expected a count >= 0")
    return value
