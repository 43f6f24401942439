"""Config mistakes as user errors: loading `configs/X.py[:size]`, applying `--config.a.b=v`
overrides, and checking a config before any work, each mistake one `JaxragError` line.

    cfg, user_set = load_config("configs/qwen.py:tiny", [("stage1.lr", "3e-4")])
    check_config(cfg, user_set)   # also what `pipeline.run` calls (user_set inferred)

What the user set = the command-line overrides plus every field whose value differs from the
reference config of the same family and size (`jaxrag.pipeline.config`): a custom config file's changes
count, the defaults a mode ignores do not.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.data import tfds_source
from jaxrag.errors import JaxragError
from jaxrag.models.families import FAMILIES
from jaxrag.pipeline.config import paper_config, tiny_config

# Sections whose keys are open-ended (Hugging Face config fields of a model trained from scratch).
OPEN_SECTIONS = ("model.arch",)
# Fields a mode never reads, with why and what to do instead. Prefix rules: a field added later
# under one of these prefixes is covered too.
_EMBEDDED = "the embedded world (model.path empty) "
NOT_READ_EMBEDDED = {
    "data.paths": _EMBEDDED + "reads its generated datasets (W/world/datasets), never data.paths; drop it, or "
                              "evaluate your file with a real model (--config.model.path=HF_DIR)",
    "data.tfds_data_dir": _EMBEDDED + "reads its generated datasets (W/world/datasets), never TFDS builds; "
                                     "drop it, or use a real model (--config.model.path=HF_DIR)",
    "data.train_sizes": _EMBEDDED + "uses its generated splits; size them with world.*_size instead",
    "data.validation_sizes": _EMBEDDED + "uses its generated splits; size them with world.*_size instead",
    "retrieval.corpus": _EMBEDDED + "retrieves from its generated corpus (W/world/corpus.jsonl); drop it, or use "
                                    "a real model (--config.model.path=HF_DIR)",
    "retrieval.passage_embeddings": _EMBEDDED + "encodes its own corpus; drop it, or use a real model",
}
_REAL = "with a real model (model.path set) "
NOT_READ_REAL = {
    "world": _REAL + "no world is generated; drop it, or leave model.path empty for the embedded world "
                     "(the seed is --config.seed)",
    "world_probe": _REAL + "the world probe does not run; drop it",
    "pretrain": _REAL + "the base is converted from the checkpoint, not pretrained; drop it",
    "model.arch": _REAL + "the architecture comes from the checkpoint; drop it",
}


def flatten(cfg: ConfigDict | dict, prefix: str = "") -> dict:
    """{"a.b.c": value} for every leaf; an empty section is a leaf `{}`."""
    out = {}
    for key, value in (cfg.items() if isinstance(cfg, dict) else cfg.items(preserve_field_references=False)):
        if isinstance(value, (ConfigDict, dict)) and len(value):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value.to_dict() if isinstance(value, ConfigDict) else value
    return out


def under(field: str, prefix: str) -> bool:
    """Whether `field` is `prefix` or inside it (prefix "" = every field)."""
    return not prefix or field == prefix or field.startswith(prefix + ".")


def closest(name: str, known: Iterable[str]) -> str | None:
    """The most likely intended field: a sibling spelled alike or abbreviated (learning_rate ->
    lr), else any field spelled alike."""
    known = sorted(known)
    section, _, leaf = name.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    initials = "".join(w[0] for w in leaf.split("_") if w)
    for cand, full in siblings.items():
        if len(leaf.split("_")) > 1 and cand == initials or cand.replace("_", "") == leaf.replace("_", ""):
            return full
    for pool, word in ((siblings, leaf), ({k: k for k in known}, name)):
        match = difflib.get_close_matches(word, list(pool), n=1, cutoff=0.6)
        if match:
            return pool[match[0]]
    return next((k for k in known if k.rpartition(".")[2] == leaf), None)  # world.seed -> seed


def _unknown(name: str, known: Iterable[str]) -> JaxragError:
    guess = closest(name, known)
    hint = f"did you mean {guess}?" if guess else "see jaxrag/pipeline/config.py for the fields"
    return JaxragError(f"config field {name} does not exist; {hint}")


# -- loading ------------------------------------------------------------------------------------

def load_file(spec: str) -> ConfigDict:
    """`path.py[:arg]` -> its `get_config(arg)`."""
    path, _, arg = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        raise JaxragError(f"--config {spec}: no such config file {path!r} (e.g. configs/qwen.py:tiny)")
    module_spec = importlib.util.spec_from_file_location(f"jaxrag_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        cfg = module.get_config(*([arg] if ":" in spec else []))
    except JaxragError as e:
        raise JaxragError(f"--config {spec}: {e}") from None
    except Exception as e:  # noqa: BLE001  a broken config file is the user's; one line, not a traceback
        raise JaxragError(f"--config {spec}: get_config failed: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, ConfigDict):
        raise JaxragError(f"--config {spec}: get_config returned {type(cfg).__name__}, not a ConfigDict")
    return cfg


def parse_value(name: str, text: str, current):
    """The command-line text of `--config.NAME=TEXT` as the type of the field's current value."""
    def bad(kind: str, example) -> JaxragError:
        return JaxragError(f"--config.{name}={text}: {name} is {kind}, e.g. --config.{name}={example}")

    if isinstance(current, bool):
        low = text.strip().lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise bad("a boolean", "true")
        return low in ("true", "1", "yes")
    if isinstance(current, int):
        if not re.fullmatch(r"\s*[-+]?\d+\s*", text):
            raise bad("an integer", current)
        return int(text)
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise bad("a number", current) from None
    if isinstance(current, (list, tuple)):
        if text.strip()[:1] in "[(":
            try:
                items = list(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                raise bad("a list", ",".join(map(str, current)) or "a,b") from None
        else:
            items = [t.strip() for t in text.split(",") if t.strip()]
        kind = type(current[0]) if current else str
        try:
            items = [kind(x) for x in items]
        except (TypeError, ValueError):
            raise bad(f"a list of {kind.__name__}", ",".join(map(str, current))) from None
        return type(current)(items)
    if isinstance(current, (ConfigDict, dict)):
        first = next(iter(current), "FIELD")
        raise JaxragError(f"--config.{name}={text}: {name} is a section; set its fields, "
                          f"e.g. --config.{name}.{first}=...")
    if current is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    return text


def apply_override(cfg: ConfigDict, name: str, text: str) -> None:
    """Sets `--config.NAME=TEXT` on `cfg`, typed by the field it replaces."""
    parts, node = name.split("."), cfg
    for depth, key in enumerate(parts[:-1]):
        if not isinstance(node, ConfigDict):
            raise JaxragError(f"--config.{name}: {'.'.join(parts[:depth])} is a value, not a section")
        if key not in node:
            raise _unknown(name, flatten(cfg))
        node = node[key]
    leaf = parts[-1]
    if not isinstance(node, ConfigDict):
        raise JaxragError(f"--config.{name}: {'.'.join(parts[:-1])} is a value, not a section")
    if leaf not in node:
        if any(under(name, p) and name != p for p in OPEN_SECTIONS):
            node[leaf] = parse_value(name, text, None)
            return
        raise _unknown(name, flatten(cfg))
    try:
        node[leaf] = parse_value(name, text, node[leaf])
    except TypeError as e:
        raise JaxragError(f"--config.{name}={text}: {e}") from None


def load_config(spec: str, overrides: Sequence[tuple[str, str]] = ()) -> tuple[ConfigDict, set[str]]:
    """The config of `--config SPEC` with `--config.NAME=TEXT` overrides applied, and the fields
    set on the command line."""
    cfg = load_file(spec)
    for name, text in overrides:
        apply_override(cfg, name, text)
    return cfg, {name for name, _ in overrides}


def split_argv(argv: Sequence[str], flag: str = "config") -> tuple[list[str], list[tuple[str, str]]]:
    """argv -> (argv without the `--config.NAME[=V]` overrides, [(NAME, V)]). `--config.NAME V`
    (a separate value) and `--noconfig.NAME` (false) are accepted as absl accepts them."""
    rest, overrides, i = [], [], 0
    pattern = re.compile(rf"^--?(no)?{flag}\.([^=]+)(?:=(.*))?$", re.S)
    while i < len(argv):
        m = pattern.match(argv[i])
        if not m:
            rest.append(argv[i])
        elif m.group(1):
            overrides.append((m.group(2), "false"))
        elif m.group(3) is not None:
            overrides.append((m.group(2), m.group(3)))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            overrides.append((m.group(2), argv[i + 1]))
            i += 1
        else:
            overrides.append((m.group(2), "true"))
        i += 1
    return rest, overrides


# -- checking -------------------------------------------------------------------------------------

def reference_config(cfg: ConfigDict) -> ConfigDict:
    """The shipped config `cfg` derives from: same family, tiny iff it has a world."""
    family = cfg.get("model", {}).get("family")
    if family not in FAMILIES:
        raise JaxragError(f"config field model.family is {family!r}; choose one of {', '.join(FAMILIES)}")
    return tiny_config(family) if "world" in cfg else paper_config(family)


def _same_type(value, ref) -> bool:
    if ref is None or value is None:
        return True
    if isinstance(ref, bool) or isinstance(value, bool):
        return isinstance(ref, bool) == isinstance(value, bool)
    if isinstance(ref, float):
        return isinstance(value, (int, float))
    if isinstance(ref, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(ref))


def user_set_fields(cfg: ConfigDict, explicit: Iterable[str] = ()) -> set[str]:
    """Fields set on the command line (`explicit`, their sub-fields included) or differing from
    the reference config."""
    ref, flat = flatten(reference_config(cfg)), flatten(cfg)
    out = {k for k, v in flat.items() if k not in ref or ref[k] != v}
    return out | {k for k in flat for e in explicit if under(k, e)}


def choices() -> dict[str, tuple[str, ...]]:
    """Fields with a closed set of values, from the modules that read them."""
    # jax loads here, not on import: `pipeline.cli` imports this module before `reuse_cpu_temporaries` runs
    from jaxrag.eval.methods import PROTOCOLS
    from jaxrag.models.decoder import REMAT_POLICIES

    return {"model.remat": tuple(REMAT_POLICIES), "eval.thresholds": PROTOCOLS}


def check_config(cfg: ConfigDict, explicit: Iterable[str] = ()) -> None:
    """Raises one JaxragError line for the config's mistakes: a field the reference config lacks
    (with the closest name) or misses, a value of the wrong type, a field the chosen mode does not
    read that the user set, a set path that does not exist."""
    ref, flat = flatten(reference_config(cfg)), flatten(cfg)
    for name, value in flat.items():
        if name not in ref and not any(under(name, p) for p in OPEN_SECTIONS):
            raise _unknown(name, ref)
        if name in ref and not _same_type(value, ref[name]):
            raise JaxragError(f"config field {name} = {value!r} is a {type(value).__name__}; "
                              f"it must be a {type(ref[name]).__name__} like {ref[name]!r}")
    for name, allowed in choices().items():
        if flat.get(name) not in allowed:
            raise JaxragError(f"config field {name}={flat.get(name)!r}: choose one of {', '.join(allowed)}")
    missing = [name for name in ref if name not in flat and not any(under(name, p) for p in OPEN_SECTIONS)]
    if missing:
        raise JaxragError(f"config field {missing[0]} is missing (configs must start from jaxrag.pipeline.config's "
                          "paper_config / tiny_config)")
    embedded = not cfg.model.path
    user = user_set_fields(cfg, explicit)
    rules = NOT_READ_EMBEDDED if embedded else NOT_READ_REAL
    problems = [f"{name} is set, but {why}" for prefix, why in rules.items()
                for name in sorted(user) if under(name, prefix) and not (name == "world.seed" and not embedded
                                                                         and flat.get("seed") == flat[name])]
    layers = cfg.model.arch.get("num_hidden_layers") if embedded else None
    if layers and not 1 <= cfg.model.datastore_layer <= layers:
        problems.append(f"model.datastore_layer={cfg.model.datastore_layer}: the model has {layers} layers "
                        f"(model.arch.num_hidden_layers); choose 1-{layers}")
    if not embedded:
        used = set(cfg.data.train) | set(cfg.data.eval)
        problems += [f"data.paths.{n} is set, but {n} is in neither data.train nor data.eval; drop it or add {n} "
                     "there" for n in sorted(cfg.data.paths) if cfg.data.paths[n] and n not in used]
        paths = {f"data.paths.{n}": cfg.data.paths[n] for n in sorted(used) if cfg.data.paths.get(n)}
        problems += tfds_problems(cfg, {k: p for k, p in paths.items() if tfds_source.is_tfds(p)})
        paths = {k: p for k, p in paths.items() if not tfds_source.is_tfds(p)}
        paths |= {f"retrieval.{k}": cfg.retrieval[k] for k in ("corpus", "passage_embeddings") if cfg.retrieval[k]}
        problems += [f"{name}={p}: no such file or directory" for name, p in paths.items() if not Path(p).exists()]
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise JaxragError(problems[0] + more)


def tfds_problems(cfg: ConfigDict, sources: dict[str, str]) -> list[str]:
    """TFDS sources (`tfds:BUILDER/CONFIG[:split]`) need `data.tfds_data_dir`, an existing folder
    unless it is a bucket (gs://...), and `data.tfds_data_dir` needs a TFDS source to read."""
    data_dir, problems = cfg.data.tfds_data_dir, []
    for name, path in sources.items():
        try:
            tfds_source.parse(path, "")
        except JaxragError as e:
            problems.append(f"{name}={e}")
    if sources and not data_dir:
        name, path = next(iter(sources.items()))
        problems.append(f"{name}={path}: a TFDS build needs --config.data.tfds_data_dir=DIR (the folder or "
                        "bucket holding the builds)")
    if data_dir and not sources:
        problems.append(f"data.tfds_data_dir={data_dir} is set, but no data.paths.NAME is a tfds: source; "
                        "drop it, or point a dataset at tfds:BUILDER/CONFIG[:split]")
    if data_dir and "://" not in data_dir and not Path(data_dir).is_dir():
        problems.append(f"data.tfds_data_dir={data_dir}: no such directory")
    return problems
