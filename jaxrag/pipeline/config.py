"""The pipeline's config, as code (ml_collections): the paper's (`paper_config`) and the embedded
default (`tiny_config`), each declared whole. `configs/*.py` pick a model and size.

Defaults are the paper's (SR-RAG §4.1, App. B): stage 1 batch 64 / lr 1e-5 / 1 epoch, stage 2
lr 5e-7 / DPO beta 0.3 / 1 epoch, n = 5 contexts per source, verbalizations <= 150 tokens,
k = 30 datastore neighbours. Override any field on the command line: `--config.stage1.lr=3e-5`.
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict

from jaxrag.errors import JaxragError
from jaxrag.models.families import FAMILIES
from jaxrag.models.tokens import DEFAULT_SOURCES
from jaxrag.world.generate import WorldConfig

TRAIN_DATASETS = ["wow", "nq", "fever", "obqa", "arc_easy", "asqa"]
EVAL_DATASETS = ["popqa", "triviaqa", "pubhealth", "arc_challenge"]
# The paper's training mixture (App. B.1, Table 5): train / validation instances per dataset,
# 50,912 + 2,677 = 53,589 (§4.1's text says 53,042; we follow the table, which lists both splits).
TABLE5_TRAIN = {"arc_easy": 2037, "nq": 14753, "obqa": 4462, "fever": 9467, "wow": 16493, "asqa": 3700}
TABLE5_VALIDATION = {"arc_easy": 107, "nq": 776, "obqa": 234, "fever": 498, "wow": 868, "asqa": 194}


def paper_config(family: str) -> ConfigDict:
    """The paper's 7B-scale setup for one model family, on real weights and data: the family's
    paper model (hub name, datastore layer, tau) from `jaxrag.models.families`."""
    paper = FAMILIES[family].paper
    path, layer, tau = paper.hub, paper.datastore_layer, paper.tau
    cfg = ConfigDict()
    cfg.seed = 0
    # stage names: stop once stop_after is done; redo rerun_from and every later stage. workers:
    # how many independent stages (and baselines trainings) run at once (`jaxrag.lanes`); one on
    # accelerators, where a device runs one program at a time and a second 7B model may not fit.
    cfg.pipeline = ConfigDict(dict(stop_after="", rerun_from="", workers=1))
    cfg.model = ConfigDict(dict(
        family=family,
        path=path,  # HF directory, hub name or jaxrag checkpoint
        sources=list(DEFAULT_SOURCES),
        dtype="auto",  # compute: bfloat16 on accelerators, float32 on CPU
        param_dtype="float32",  # master weights
        max_length=1024,  # training sequence length (tokens)
        datastore_layer=layer,
        # What training keeps of each layer for the backward pass: "none" (everything), "block"
        # (only its input; the layer is recomputed, ~1/3 more compute) or "dots" (its matmul
        # outputs too). A 7B step at batch 64 x 1024 on 8 x 80 GB fits with "block" (jaxrag.plan).
        remat="block",
        # LoRA for both stages (rank 0 = full fine-tuning, the paper's): adapters on `targets`
        # among q k v o gate up down, scaled alpha / rank, dropout on their input while training,
        # plus the SR-RAG tokens' embedding rows; the frozen base in base_dtype ("auto":
        # bfloat16 on accelerators, float32 on CPU).
        lora=ConfigDict(dict(rank=0, alpha=32.0, targets=["q", "k", "v", "o", "gate", "up", "down"], dropout=0.0)),
        base_dtype="auto",
        arch=ConfigDict(),  # only for models trained from scratch (the tiny config)
    ))
    cfg.retrieval = ConfigDict(dict(
        encoder="facebook/dpr-question_encoder-single-nq-base",
        corpus="",  # DPR psgs_w100.tsv or JSONL {"id", "contents"}
        passage_embeddings="",  # DPR's released wikipedia_passages_*.pkl (optional)
        n_passages=5,
    ))
    # Datasets by name; `paths.NAME` = a local file in its public format, or a TFDS build
    # `tfds:BUILDER/CONFIG[:split]` in `tfds_data_dir` (a folder or bucket); empty: the HF hub.
    # Validation comes from the training mixture (Table 5), never from the test sets, which stay
    # whole (PopQA long tail: all 1,399). Larger files / hub splits are sampled by the seed.
    cfg.data = ConfigDict(dict(train=list(TRAIN_DATASETS), eval=list(EVAL_DATASETS),
                               train_sizes=dict(TABLE5_TRAIN), validation_sizes=dict(TABLE5_VALIDATION),
                               paths={name: "" for name in TRAIN_DATASETS + EVAL_DATASETS}, tfds_data_dir=""))
    cfg.construct = ConfigDict(dict(
        n_contexts=5,  # per source
        verbalize_max_tokens=150,
        kmeans_clusters=5,
        demos_per_cluster=5,
        label_rule="sum",  # Algorithm 1 line 11; "majority" = the text's majority of the top-n
        verbalize_temperature=0.7,  # GenRead round 2 sampling (round 1 is greedy)
        verbalize_top_p=0.9,
        max_prompt_tokens=0,  # GenRead prompt budget; 0 = max positions - verbalize_max_tokens
        shard_size=256,  # questions per output shard (the unit of resumption)
        generate_batch_size=64,
        score_batch_size=32,
    ))
    # per_device_batch_size: rows (stage 2: pairs) per data shard per micro-step (0 = the whole
    # batch at once); gradient accumulation keeps the global batch at batch_size on any device
    # count. 8: on 8 devices (docs/scale.md) the batch of 64 in one pass; on fewer it accumulates
    # instead of growing per-device memory (one 80 GB GPU with LoRA fits, `jaxrag.plan`).
    run = dict(per_device_batch_size=8, checkpoint_every=200, keep_checkpoints=3, log_every=10)
    # token_lr_scale: the SR-RAG tokens' rows learn at lr x this (the paper: one lr for all).
    run.update(token_lr_scale=1.0)
    cfg.stage1 = ConfigDict(dict(batch_size=64, lr=1e-5, epochs=1, warmup_ratio=0.03,
                                 weight_decay=0.0, grad_clip=1.0, extra_passages_lambda=2.0, **run))
    cfg.stage2 = ConfigDict(dict(batch_size=64, lr=5e-7, epochs=1, warmup_ratio=0.03,
                                 weight_decay=0.0, grad_clip=1.0, dpo_beta=0.3, extra_passages_lambda=2.0, **run))
    # tau on p_M(<Wiki>) * p_D(<Wiki>) (w/o kNN: on p_M alone); selective_tau on Selective RAG's
    # p(<Wiki>) after <EOQ>: the paper's uniform, model-specific constants (§4.1, §4.2).
    cfg.inference = ConfigDict(dict(k=30, tau=tau, selective_tau=0.2, batch_size=10, max_answer_tokens=64,
                                    max_knowledge_tokens=768))
    # thresholds: "paper" = the constants above (and IK's 0.5, SeaKR's training-fitted cut, CCSK's
    # published taus); "validation" = an opt-in variant tuning every threshold for accuracy on the
    # training mixture's validation split, reported under its own name. Intervals: percentile
    # bootstrap over questions (stratified by dataset, paired across methods). Latency: real
    # routed batches of inference.batch_size on the first latency_questions of each test set.
    cfg.eval = ConfigDict(dict(thresholds="paper", bootstrap_samples=1000, latency_questions=100,
                               latency_sweep_points=5))
    # The seeds' other selectors (IK: 32 answer tokens; SeaKR: 20 samples), fitted on at most
    # this many training questions, stratified over the training datasets.
    cfg.baselines = ConfigDict(dict(ik_answer_tokens=32, seakr_samples=20, max_train_questions=5000))
    # -1 = the remaining devices. A 7B model with AdamW (~112 GB) must be split: FSDP over all.
    cfg.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    # Generation (construct, the datastore, eval): every device of every process; each process
    # places the model on its own devices (`jaxrag.sharding.generation_mesh`), split over the
    # model axis `tensor` (0 = only as far as it must be to fit; a size divides the devices per
    # process), the other devices each taking their share of a batch's rows.
    cfg.generation = ConfigDict(dict(tensor=0))
    return cfg


def tiny_config(family: str) -> ConfigDict:
    """The embedded default (`configs/qwen.py:tiny`, `configs/llama2.py:tiny`, `configs/phi3.py:tiny`):
    a CPU-size model of `family` trained from scratch on the generated knowledge world, with the
    paper's recipe scaled down to minutes. Every field is declared here, one comment each; the
    measurements behind the chosen constants: docs/embedded-world.md."""
    cfg = ConfigDict()
    cfg.seed = 0  # initialisation, data order and (world.seed below) the world itself
    cfg.pipeline = ConfigDict(dict(
        stop_after="",  # stop once this stage is done ("": run every stage)
        rerun_from="",  # redo this stage and every later one ("": none)
        workers=2,  # two stages at a time fill a 2-core CPU better than one (jaxrag.pipeline.lanes); same results
    ))
    cfg.model = ConfigDict(dict(
        family=family,  # the decoder's architecture family (a key of jaxrag.models.families.FAMILIES)
        path="",  # empty: trained from scratch in the `base` stage (the embedded world)
        sources=list(DEFAULT_SOURCES),  # knowledge sources, one token each: <Wiki>, <Self>
        dtype="float32",  # compute dtype
        param_dtype="float32",  # master weights
        max_length=256,  # training sequence length (tokens)
        # The policy datastore's key layer: the best mean within-dataset leave-one-out AUROC of the
        # datastore's labels (`python -m jaxrag.datastore audit`) over layers 1-4 x k in {5, 10, 30}, on
        # the training data of two development worlds: the last layer (a 4-layer model's middle layer
        # encodes the template, its last one whether the model knows the entity); k below.
        datastore_layer=4,
        remat="none",  # keep every activation: fastest on a CPU, and the tiny model's activations are small
        lora=ConfigDict(dict(
            rank=0,  # 0: full fine-tuning (the paper's)
            alpha=32.0,  # adapters scaled alpha / rank (when rank > 0)
            targets=["q", "k", "v", "o", "gate", "up", "down"],  # the projections that get adapters
            dropout=0.0,  # on the adapters' input while training
        )),
        base_dtype="auto",  # the frozen base under LoRA ("auto": bfloat16 on accelerators, float32 on CPU)
        # Hugging Face config fields of the model trained from scratch: hidden 128 learns to read within
        # the pretraining budget below, at 1.6x the step speed of hidden 256 (fresh-entity reading probe).
        arch=ConfigDict(dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512)),
    ))
    cfg.retrieval = ConfigDict(dict(
        encoder="minilm",  # all-MiniLM-L6-v2 from the offline package
        corpus="",  # empty: the world's generated corpus (W/world/corpus.jsonl)
        passage_embeddings="",  # empty: the index encodes the corpus itself
        # One ~100-word passage fills the tiny model's 256-token training context (5 would run past
        # its 512 positions); the answer budget and cache stay within them.
        n_passages=1,
    ))
    cfg.data = ConfigDict(dict(
        train=list(TRAIN_DATASETS),  # the world's training mixture, named as the paper's six sets
        eval=list(EVAL_DATASETS),  # the world's four evaluation sets, named as the paper's
        train_sizes=dict(TABLE5_TRAIN),  # not read: the world sizes its splits (world.*_size)
        validation_sizes=dict(TABLE5_VALIDATION),  # not read: the world sizes its splits
        paths={name: "" for name in TRAIN_DATASETS + EVAL_DATASETS},  # not read: the world's datasets
        tfds_data_dir="",  # not read: the world's datasets
    ))
    # GenRead round 2 zero-shot (sampled, n = 5), without the paper's cluster demonstrations: a
    # 3M-parameter model copies the demo's entity instead of learning in context (on training
    # questions, one demo put the gold answer in 5% of documents, zero-shot in 67%). Prompts stay
    # within the 256-token pretraining length.
    cfg.construct = ConfigDict(dict(
        n_contexts=5,  # retrieved passages and verbalizations per source (the paper's n)
        verbalize_max_tokens=48,  # GenRead document length
        kmeans_clusters=5,  # GenRead's question clusters
        demos_per_cluster=0,  # zero-shot (above)
        label_rule="sum",  # Algorithm 1 line 11
        verbalize_temperature=0.7,  # GenRead round 2 sampling (round 1 is greedy)
        verbalize_top_p=0.9,  # GenRead round 2 nucleus
        max_prompt_tokens=208,  # GenRead prompt budget: 208 + 48 = the 256-token pretraining length
        shard_size=256,  # questions per output shard (the unit of resumption)
        generate_batch_size=64,  # rows per generation batch
        score_batch_size=32,  # rows per likelihood-scoring batch
    ))
    # Stage 1: lr 3e-4 keeps the base's reading; the SR-RAG tokens' new rows at 30x lr learn to route
    # in 3 epochs without bending the body. Chosen among {6 x 10, 6 x 30, 3 x 30} (epochs x scale) on
    # the fresh-entity reading probe and the validation split's p_M AUROC (never a test question).
    cfg.stage1 = ConfigDict(dict(
        batch_size=16,  # questions per optimizer step
        lr=3e-4,  # peak learning rate (above)
        epochs=3,  # passes over the construct records (above)
        warmup_ratio=0.03,  # share of steps warming up (the paper's)
        weight_decay=0.0,  # AdamW decay (the paper's)
        grad_clip=1.0,  # global gradient-norm clip
        extra_passages_lambda=2.0,  # weight of the extra-passages term (Eq. 4)
        per_device_batch_size=0,  # 0: the whole batch in one pass
        checkpoint_every=200,  # steps between checkpoints
        keep_checkpoints=3,  # checkpoints kept while it trains (removed once its model is saved)
        log_every=10,  # steps between metric lines
        token_lr_scale=30.0,  # the SR-RAG tokens' rows learn at lr x this (above)
    ))
    cfg.stage2 = ConfigDict(dict(
        batch_size=16,  # preference pairs per optimizer step
        lr=1e-4,  # peak learning rate
        epochs=2,  # passes over the construct records
        warmup_ratio=0.03,  # share of steps warming up (the paper's)
        weight_decay=0.0,  # AdamW decay (the paper's)
        grad_clip=1.0,  # global gradient-norm clip
        dpo_beta=0.3,  # DPO's beta (Eq. 5, the paper's)
        extra_passages_lambda=2.0,  # weight of the extra-passages term
        per_device_batch_size=0,  # 0: the whole batch in one pass
        checkpoint_every=200,  # steps between checkpoints
        keep_checkpoints=3,  # checkpoints kept while it trains (removed once its model is saved)
        log_every=10,  # steps between metric lines
        token_lr_scale=1.0,  # the SR-RAG tokens' rows at the body's lr
    ))
    cfg.inference = ConfigDict(dict(
        k=10,  # datastore neighbours: chosen with the datastore layer above (same audit, same worlds)
        # The uniform thresholds, fixed once per recipe as the paper fixes its model-specific tau: the
        # best point of a 0.05 grid (ties: less retrieval) of `python -m jaxrag.eval.tau` on the training
        # mixture's validation split of development worlds 0 and 1, before any held-out seed ran
        # (validation accuracy 0.749 at 54% retrieval; Selective RAG 0.731 at 58%).
        tau=0.10,  # on p_M(<Wiki>) * p_D(<Wiki>) (w/o kNN: on p_M alone)
        selective_tau=0.25,  # on Selective RAG's p(<Wiki>) after <EOQ>
        batch_size=16,  # questions per routed batch
        max_answer_tokens=16,  # answer budget
        max_knowledge_tokens=224,  # knowledge budget (passages or verbalization), within 512 positions
    ))
    cfg.eval = ConfigDict(dict(
        thresholds="paper",  # the constants above; "validation": tuned on the validation split (opt-in)
        bootstrap_samples=1000,  # percentile bootstrap over questions
        latency_questions=100,  # first questions of each test set timed in routed batches
        latency_sweep_points=5,  # Figure 4's thresholds
    ))
    cfg.baselines = ConfigDict(dict(
        ik_answer_tokens=32,  # IK's probe reads the first answer tokens
        seakr_samples=5,  # SeaKR's sampled generations per question
        max_train_questions=400,  # the selectors' training sample, stratified over the training sets
    ))
    cfg.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # every device on the data axis (-1: the rest)
    cfg.generation = ConfigDict(dict(tensor=0))  # generation's model axis (0: only as far as it must; jaxrag.sharding)
    # The world's generator settings: WorldConfig's defaults (jaxrag/world/generate.py, one comment
    # per field there); `--config.world.seed=N` and `--config.seed=N` are one field.
    cfg.world = ConfigDict({k: v for k, v in dataclasses.asdict(WorldConfig()).items() if k != "seed"})
    cfg.world.seed = cfg.get_ref("seed")
    # questions: per popularity bucket, descriptive only. The gates: a base must answer
    # reading_gate of reading_questions fresh-entity questions with retrieved passages, and its
    # GenRead documents must state the rule for verbal_gate of rule_questions fresh rule questions
    # (neither ever a test question), or be pretrained again from a new initialisation,
    # `attempts` runs in all. verbal_gate is the reading gate's 0.8, not fitted: bases score near
    # 1.0 or near 0.25 (`pipeline.base.pretrain_until_it_reads_and_verbalizes`).
    cfg.world_probe = ConfigDict(dict(
        questions=100,  # per popularity bucket (descriptive)
        reading_questions=200,  # fresh-entity questions of the reading gate
        reading_gate=0.8,  # share the base must read
        rule_questions=200,  # fresh rule questions of the verbalization gate
        verbal_gate=0.8,  # share whose GenRead documents must state the rule
        attempts=2,  # pretraining runs at most
        # A base below the reading gate after the last attempt stops the run (exit 2, one line);
        # True keeps the best attempt and runs on, recorded as reading_gate_passed: false in
        # results.json, and `python -m jaxrag.eval.seeds` refuses such a run.
        allow_failed_reading_gate=False,
    ))
    # The base model's whole education: 1400 steps x 8 x 256 = 2.9M tokens of world text, ~9 min
    # on a 2-core CPU; the fewest steps after which development bases read passages (reading
    # switches on late: fewer steps or a lower lr left the probe far below the gate).
    cfg.pretrain = ConfigDict(dict(
        batch_size=8,  # documents per step
        lr=2e-3,  # peak learning rate (above)
        steps=1400,  # optimizer steps (above)
        warmup_ratio=0.05,  # share of steps warming up
        weight_decay=0.01,  # AdamW decay
        grad_clip=1.0,  # global gradient-norm clip
        checkpoint_every=100,  # steps between checkpoints
    ))
    return cfg


def get_config_for(family: str, arg: str | None) -> ConfigDict:
    """`configs/<family>.py:<arg>`: '' -> the paper's setup, 'tiny' -> the embedded default."""
    sizes = {"": paper_config, "tiny": tiny_config}
    if (arg or "") not in sizes:
        raise JaxragError(f"unknown config size {arg!r}; choose ':tiny' (the embedded CPU default) or no size "
                          f"(the paper's {family} model)")
    return sizes[arg or ""](family)
