"""Serving SR-RAG from an export: `SRRAG.load(W / "export").ask(questions)`.

An SR-RAG model needs more than its weights to route: the policy datastore (kNN p_D over `<EOQ>`
hidden states), tau and k, and a passage index for `<Wiki>` rows. The export stage bundles them
beside the Hugging Face files:

    export/                 config.json, model.safetensors, tokenizer*, generation_config.json
    export/policy_datastore the datastore (a copy: the export is self-contained)
    export/srrag.json       tau, k, the route settings, and the passage index + query encoder

transformers reads the directory as a plain causal LM; jaxrag reads it as the whole method.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from jaxrag.decode.routing import RouteConfig, Routed, route
from jaxrag.errors import JaxragError
from jaxrag.decode.sampler import place_for_generation
from jaxrag.models.model import load_model
from jaxrag.policies.srrag import datastore_neighbours, srrag_policy
from jaxrag.retrieval.datastore import PolicyDatastore
from jaxrag.retrieval.retriever import Retriever

SERVING_FILE = "srrag.json"
DATASTORE_DIR = "policy_datastore"


def write_serving_files(export_dir: Path, datastore_dir: Path, *, tau: float, k: int, route_cfg: RouteConfig,
                        index_dir: Path, encoder: str | None, n_passages: int) -> None:
    """Adds the datastore copy and `srrag.json` to an export directory (still being built)."""
    shutil.copytree(datastore_dir, export_dir / DATASTORE_DIR)
    rc = dataclasses.asdict(route_cfg)
    rc.pop("sampling")  # greedy, as evaluated
    spec = {"tau": float(tau), "k": int(k), "route": rc, "n_passages": int(n_passages),
            "index": str(Path(index_dir).resolve()), "encoder": encoder}
    (export_dir / SERVING_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")


def read_serving_spec(export_dir: Path) -> dict:
    path = Path(export_dir) / SERVING_FILE
    if not path.is_file():
        raise JaxragError(f"{path}: missing; SR-RAG exports from `python -m jaxrag.train` carry it "
                          "(a bare checkpoint routes only with an explicit datastore, tau and index)")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        missing = [f for f in ("tau", "k", "route", "n_passages", "index") if f not in spec]
    except (json.JSONDecodeError, TypeError) as e:
        raise JaxragError(f"{path}: not valid JSON ({e})") from None
    if missing:
        raise JaxragError(f"{path}: missing field(s) {', '.join(missing)}")
    return spec


@dataclasses.dataclass
class SRRAG:
    """A loaded SR-RAG system: model, policy (p_M x p_D > tau), retriever, route settings."""

    model: object
    datastore: object
    retriever: object
    tau: float
    k: int
    route_cfg: RouteConfig
    n_passages: int

    @classmethod
    def load(cls, export_dir: str | os.PathLike, *, index: str | os.PathLike | None = None,
             tau: float | None = None, k: int | None = None, tensor: int = 0) -> SRRAG:
        """`index` overrides the passage index recorded at export (e.g. on another machine). The
        model is placed on this host's devices (`sampler.place_for_generation`): split over
        `tensor` of them (0 = only as far as it must be to fit), the others data replicas."""
        export_dir = Path(export_dir)
        spec = read_serving_spec(export_dir)
        model = load_model(export_dir, inference=True)
        model = dataclasses.replace(model, decoder=place_for_generation(model.decoder, tensor)[0])
        return cls(model=model, datastore=PolicyDatastore.load(export_dir / DATASTORE_DIR),
                   retriever=Retriever.load(index or spec["index"], spec.get("encoder")),
                   tau=float(spec["tau"] if tau is None else tau), k=int(spec["k"] if k is None else k),
                   route_cfg=RouteConfig(**spec["route"]), n_passages=int(spec["n_passages"]))

    def ask(self, questions: Sequence[str], max_tokens: Sequence[int] | None = None) -> list[Routed]:
        """Routes, verbalizes or retrieves, and answers the questions (one batch, one pass);
        `max_tokens`, each question's answer budget (default: the export's `max_answer_tokens`)."""
        policy = srrag_policy(datastore_neighbours(self.datastore, self.k), self.tau)
        return route(self.model, list(questions), policy, lambda qs: self.retriever.retrieve_texts(qs, self.n_passages),
                     self.route_cfg, max_tokens=max_tokens)


def describe(r: Routed, sources: Sequence[str]) -> str:
    """One question's route as text: source, p_M, p_D, knowledge, answer, latency split."""
    p_m = ", ".join(f"{s}={p:.2f}" for s, p in zip(sources, r.p_model))
    p_d = "-" if r.p_datastore is None else ", ".join(f"{s}={p:.2f}" for s, p in zip(sources, r.p_datastore))
    latency = ", ".join(f"{k}={v * 1000:.0f}ms" for k, v in r.latency.items())
    return (f"Q: {r.question}\n  source: <{r.source}>  p_M: {p_m}  p_D: {p_d}\n"
            f"  knowledge: {r.knowledge.strip()[:300]}\n  answer: {r.answer.strip()}\n  latency: {latency}")
