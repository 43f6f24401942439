"""LoRA: adapters that start as the identity, equal their merged weights, and train alone with
the SR-RAG tokens' rows (stage 1 and 2, resume, export)."""

from __future__ import annotations

import json

import jax
import orbax.checkpoint as ocp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxrag.errors import JaxragError
from jaxrag.models import lora as L
from jaxrag.models.decoder import LORA_TARGETS
from jaxrag.models.tokens import srrag_tokens
import jaxrag
from jaxrag import sharding
from jaxrag.export import main as export_cli
from jaxrag.train import stages, trainer
from train_fixtures import stopped_after, tiny_model, toy_records, train_config

ALL = list(LORA_TARGETS)
IDS = np.random.default_rng(0).integers(0, 300, (2, 12))


def pure(model) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.decoder)))


def with_random_b(model, seed=1):
    """Adapters with nonzero B (as after training), so the LoRA path changes the logits."""
    params, rng = flatten_dict(pure(model)), np.random.default_rng(seed)
    for path, v in params.items():
        if path[-1].endswith("_lora_b"):
            params[path] = (rng.standard_normal(v.shape) * 0.05).astype(v.dtype)
    state = nnx.state(model.decoder)
    nnx.replace_by_pure_dict(state, unflatten_dict(params))
    nnx.update(model.decoder, state)
    return model


@pytest.fixture(scope="module")
def base():
    return tiny_model(0)


def test_untrained_adapters_change_nothing(base):
    adapted = L.add_lora(base, 4, 8.0, ALL)
    np.testing.assert_array_equal(np.asarray(adapted.logits(IDS)), np.asarray(base.logits(IDS)))
    shapes = flatten_dict(jax.tree.map(np.shape, pure(adapted)))
    # stacked layers: A [layers, inputs..., rank], B [layers, rank, outputs...]
    assert shapes[("layers", "attn", "wq_lora_a")] == (2, 32, 4)
    assert shapes[("layers", "attn", "wq_lora_b")] == (2, 4, 4, 8)
    assert shapes[("layers", "attn", "wo_lora_a")] == (2, 4, 8, 4)
    assert shapes[("layers", "mlp", "w_down_lora_b")] == (2, 4, 32)
    assert L.add_lora(adapted, 8, 1.0, ["q"]) is adapted  # stage 2 continues stage 1's adapter


def test_lora_forward_equals_merged_weights(base):
    adapted = with_random_b(L.add_lora(base, 4, 8.0, ALL))
    lora_logits = np.asarray(adapted.logits(IDS))
    assert np.abs(lora_logits - np.asarray(base.logits(IDS))).max() > 1e-2
    merged = L.merge_lora(adapted)
    assert merged.config.lora_rank == 0 and not any(L._is_lora(p) for p in flatten_dict(pure(merged)))
    np.testing.assert_allclose(np.asarray(merged.logits(IDS)), lora_logits, atol=2e-5)
    # by hand for one weight: W + alpha/rank * A @ B
    a, b = pure(adapted)["layers"]["mlp"]["w_up_lora_a"][0], pure(adapted)["layers"]["mlp"]["w_up_lora_b"][0]
    np.testing.assert_allclose(pure(merged)["layers"]["mlp"]["w_up"][0],
                               pure(base)["layers"]["mlp"]["w_up"][0] + 2.0 * a @ b, atol=1e-6)


def test_inference_model_merges_adapters_once(base):
    """`for_inference`: adapters merged into the weights (no adapter left), layers unstacked,
    the adapted model's logits and greedy tokens; `host_params` gives training's layout back."""
    from jaxrag.decode.sampler import generate
    from jaxrag.models.model import for_inference
    from jaxrag.models.params import host_params

    adapted = with_random_b(L.add_lora(base, 4, 8.0, ALL))
    fast = for_inference(adapted)
    assert fast.config.lora_rank == 0 and not any(L._is_lora(p) for p in flatten_dict(pure(fast)))
    np.testing.assert_allclose(np.asarray(fast.logits(IDS)), np.asarray(adapted.logits(IDS)), atol=2e-5)
    prompts = IDS.tolist()
    assert generate(fast.decoder, prompts, 6) == generate(adapted.decoder, prompts, 6)
    merged = flatten_dict(host_params(L.merge_lora(adapted).decoder))
    assert {k: v.shape for k, v in flatten_dict(host_params(fast.decoder)).items()} == \
        {k: v.shape for k, v in merged.items()}


def test_bad_targets_are_refused(base):
    with pytest.raises(JaxragError, match=r"model.lora.targets=\['qkv'\]: choose among q, k, v, o"):
        L.add_lora(base, 4, 8.0, ["qkv"])


def test_trainable_split_join_round_trip(base):
    adapted = L.add_lora(base, 2, 4.0, ["q", "down"])
    t = L.Trainable.for_model(adapted, "float32")
    assert t.row_ids == tuple(adapted.token_id(tok) for tok in srrag_tokens(adapted.sources))
    train, frozen = t.split(pure(adapted))
    assert set(flatten_dict(train)) == {("layers", "attn", "wq_lora_a"), ("layers", "attn", "wq_lora_b"),
                                   ("layers", "mlp", "w_down_lora_a"), ("layers", "mlp", "w_down_lora_b"),
                                   (L.ROWS, "embed"), (L.ROWS, "lm_head")}
    assert train[L.ROWS]["embed"].shape == (4, 32)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, t.join(train, frozen)), pure(adapted))
    assert L.Trainable.for_model(base).split(pure(base))[1] == {}  # no adapters: everything trains


def lora_config(dropout=0.0, **stage1):
    cfg = train_config(stage1=stage1)
    cfg.model.lora = dict(rank=4, alpha=8.0, targets=["q", "v", "up"], dropout=dropout)
    cfg.model.base_dtype = "float32"
    return cfg


def test_stages_train_only_adapters_and_token_rows(tmp_path, base):
    records, cfg = toy_records(10), lora_config()
    with stopped_after(2):
        stages.train_stage1(base, records, cfg, tmp_path / "s1")
    saved = ocp.StandardCheckpointer().metadata((tmp_path / "s1" / "checkpoints" / "2" / "state").absolute())
    s1 = stages.train_stage1(base, records, cfg, tmp_path / "s1")  # resumes, finishes step 3
    assert not (tmp_path / "s1" / "checkpoints").exists()  # removed with the final model saved
    assert s1.config.lora_targets == ("q", "v", "up")
    before, after = flatten_dict(pure(base)), flatten_dict(pure(s1))
    rows = [s1.token_id(t) for t in srrag_tokens(s1.sources)]
    others = np.setdiff1d(np.arange(before[("embed",)].shape[0]), rows)
    for path, value in after.items():
        if L._is_lora(path):
            continue
        if path in (("embed",), ("lm_head",)):
            axis = 0 if path == ("embed",) else 1
            np.testing.assert_array_equal(value.take(others, axis), before[path].take(others, axis))
            assert not np.allclose(value.take(rows, axis), before[path].take(rows, axis))
        else:
            np.testing.assert_array_equal(value, before[path], err_msg=str(path))
    assert not np.allclose(after[("layers", "attn", "wq_lora_b")], 0)
    # The optimizer's state (what the checkpoints hold) exists only for what trains: Adam's two
    # moments of the adapters and the 4 tokens' embed + lm_head rows (hidden 32).
    n_train = sum(v.size for p, v in after.items() if L._is_lora(p)) + 2 * 4 * 32
    spec = trainer.TrainSpec("stage1", batch_size=4, lr=1e-3, total_steps=3)
    abstract, _ = trainer.state_shardings(s1.decoder, spec, sharding.make_mesh(cfg.mesh), L.Trainable.for_model(s1))
    assert sum(x.size for x in jax.tree.leaves(abstract["params"])) == n_train
    assert sum(x.size for x in jax.tree.leaves(abstract["opt"])) == 2 * n_train + 2  # + two step counts
    assert sum(np.prod(m.shape) for m in jax.tree.leaves(saved.item_metadata.tree)) == 3 * n_train + 3

    reloaded = stages.train_stage1(base, records, cfg, tmp_path / "s1")  # finished: loads, adapters included
    assert reloaded.config.lora_rank == 4
    np.testing.assert_array_equal(np.asarray(reloaded.logits(IDS)), np.asarray(s1.logits(IDS)))

    s2 = stages.train_stage2(s1, s1, records, cfg, tmp_path / "s2")  # continues the stage-1 adapter
    mid, end = flatten_dict(pure(s1)), flatten_dict(pure(s2))
    assert not np.allclose(end[("layers", "attn", "wq_lora_b")], mid[("layers", "attn", "wq_lora_b")])
    np.testing.assert_array_equal(end[("layers", "attn", "wk")], before[("layers", "attn", "wk")])

    # The CLI: merged by default, a PEFT adapter with --adapter, a clear error without adapters.
    export = lambda *a: export_cli(["--checkpoint", str(tmp_path / "s2" / stages.FINAL), *a])
    export("--out", str(tmp_path / "merged"))
    export("--out", str(tmp_path / "adapter"), "--adapter")
    assert set(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]) == \
        {"q_proj", "up_proj", "v_proj"}  # PEFT keeps them as a set
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    jaxrag.save_model(base, tmp_path / "plain")
    with pytest.raises(SystemExit) as err:
        export_cli(["--checkpoint", str(tmp_path / "plain"), "--out", str(tmp_path / "no"), "--adapter"])
    assert err.value.code == 2 and not (tmp_path / "no").exists()


def test_resume_equals_uninterrupted(tmp_path, base):
    """Checkpoints hold the trainable state only; resuming from one (the run stopped after step
    2 of 3) gives the uninterrupted run's adapters, LoRA dropout's draws included."""
    records, cfg = toy_records(10), lora_config(dropout=0.1, checkpoint_every=1)
    straight = stages.train_stage1(base, records, cfg, tmp_path / "straight")
    no_dropout = stages.train_stage1(base, records, lora_config(checkpoint_every=1), tmp_path / "no_dropout")
    assert not np.allclose(pure(straight)["layers"]["attn"]["wq_lora_b"], pure(no_dropout)["layers"]["attn"]["wq_lora_b"])
    partial = tmp_path / "partial"
    with stopped_after(2):
        stages.train_stage1(base, records, cfg, partial)
    assert [json.loads(line)["step"] for line in (partial / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    resumed = stages.train_stage1(base, records, cfg, partial)
    jax.tree.map(np.testing.assert_array_equal, pure(resumed), pure(straight))


@pytest.mark.parametrize("variant,targets", [("qwen2", ["q", "v", "o", "down"]), ("qwen2_tied", ["k", "up"]),
                                             ("phi3", ["q", "v", "gate", "up", "down"])])
def test_merged_export_and_peft_adapter_load_with_our_logits(tmp_path, variant, targets):
    """After "training" (random B, moved SR-RAG rows): the merged export in transformers and the
    PEFT adapter on the converted base (tokens added, adapters absent) give our logits. Phi-3's
    q/v and gate/up adapters land on its fused qkv_proj / gate_up_proj."""
    import torch
    import transformers
    from peft import PeftModel

    import jaxrag
    from hf_fixtures import make_hf_model
    from jaxrag.models.peft_export import export_adapter

    make_hf_model(tmp_path / "hf", variant, spare_rows=0)
    base = jaxrag.add_special_tokens(jaxrag.load_model(tmp_path / "hf"))
    jaxrag.export_hf(base, tmp_path / "base")
    adapted = with_random_b(L.add_lora(base, 4, 8.0, targets))
    params, rows = flatten_dict(pure(adapted)), [adapted.token_id(t) for t in srrag_tokens(adapted.sources)]
    params[("embed",)][rows] += 0.3  # the rows training moves
    if ("lm_head",) in params:
        params[("lm_head",)][:, rows] -= 0.3
    state = nnx.state(adapted.decoder)
    nnx.replace_by_pure_dict(state, unflatten_dict(params))
    nnx.update(adapted.decoder, state)

    export_adapter(adapted, tmp_path / "adapter")
    jaxrag.export_hf(adapted, tmp_path / "merged")
    ids = [[5, 17, *rows, 40, 9, rows[1], 33]]
    ours = np.asarray(adapted.logits(ids))[0, :, : adapted.config.vocab_size]
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        np.testing.assert_allclose(merged(torch.tensor(ids)).logits[0].numpy(), ours, atol=1e-4)
        on_base = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                            tmp_path / "adapter").eval()
        np.testing.assert_allclose(on_base(torch.tensor(ids)).logits[0].numpy(), ours, atol=1e-4)
    assert np.abs(ours - np.asarray(base.logits(ids))[0, :, : base.config.vocab_size]).max() > 1e-2


def test_lora_dropout_is_inverted_dropout_on_the_adapter_input():
    """Each input unit of A kept with probability 1 - rate and scaled by 1 / (1 - rate): the mean
    over keys is the adapter's output without dropout; a key gives the same draw every time."""
    from jaxrag.models.decoder import MLP, DecoderConfig, LoraDropout, lora_delta

    cfg = DecoderConfig(family="llama", vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=8, lora_rank=4, lora_alpha=8.0, lora_targets=("up",))
    mlp = MLP(cfg, nnx.Rngs(0))
    mlp.w_up_lora_b[...] = np.random.default_rng(0).standard_normal((4, 24)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    want = np.asarray(lora_delta(mlp, "w_up", x, 1))
    np.testing.assert_allclose(want, 2.0 * x @ np.asarray(mlp.w_up_lora_a[...]) @ np.asarray(mlp.w_up_lora_b[...]),
                               rtol=1e-5, atol=1e-5)
    draws = [np.asarray(lora_delta(mlp, "w_up", x, 1, LoraDropout(0.3, jax.random.key(k)))) for k in range(2000)]
    assert not np.allclose(draws[0], want) and not np.allclose(draws[0], draws[1])
    np.testing.assert_array_equal(draws[5], np.asarray(lora_delta(mlp, "w_up", x, 1, LoraDropout(0.3, jax.random.key(5)))))
    np.testing.assert_allclose(np.mean(draws, axis=0), want, atol=0.06 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(lora_delta(mlp, "w_up", x, 1, LoraDropout(0.0, jax.random.key(0)))), want)
