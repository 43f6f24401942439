"""The paper configs fit 8 x 80 GB by XLA's memory analysis (`python -m jaxrag.plan`, 8 fake CPU
devices in a subprocess), generation planned as the run places it (one process's devices, the
model split over `tensor` only as far as it must be), the fit report, and the attention path/mask
choice.

Compile budget (measured on a 2-core CPU): every program of Qwen2.5-7B ~80 s; the two train
steps of Llama-2-7B and Phi-3.5-mini ~25 s each. So Qwen is planned whole (through the CLI) and
the other two families' train steps only; `jaxrag.plan` covers the rest.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrag.models import decoder as decoder_mod
from jaxrag.models import masks
from jaxrag.models.decoder import attention_implementation
from jaxrag.plan.fit import (ACCELERATORS, DEVICES_PER_HOST, PLAN_XLA_FLAGS, Row, accelerator_of, devices_per_process,
                             failures)

REPO = Path(__file__).resolve().parents[1]
USABLE_GB = 80 * 0.75  # JAX's default preallocation of an 80 GB device
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def test_qwen_paper_config_every_program_fits_8x80gb(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "jaxrag.plan", "--config", "configs/qwen.py", "--devices", "8",
                           "--accelerator", "h100", "--device-memory-gb", "80", "--json", str(out)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    rows = {r["name"]: r for r in plan["programs"]}
    assert set(rows) == {"stage1 step", "stage2 step", "DPO reference scoring", "construct generation: prefill",
                         "construct generation: decode step", "construct likelihood scoring",
                         "routed decoding: knowledge prefill", "routed decoding: decode step", "retriever encoder"}
    for r in rows.values():
        assert r["fits"] and 0 < r["peak_gb"] <= 0.9 * USABLE_GB, r
    # Generation on the one host's 8 devices: the bf16 inference weights (15.2 GB) take less than
    # half of the 54 GB usable, so every device holds them whole, all 8 on data; training stays FSDP.
    assert plan["generation"] == dict(processes=1, devices_per_process=8, data=8, tensor=1,
                                      weight_gb=pytest.approx(15.2, abs=0.1))
    assert rows["routed decoding: decode step"]["mesh"] == dict(data=8, fsdp=1, tensor=1)
    assert rows["stage1 step"]["mesh"] == dict(data=1, fsdp=8, tensor=1)
    assert rows["construct generation: decode step"]["peak_gb"] > 15.2  # the whole weights
    # f32 master weights + Adam moments alone are 16 bytes x 7.6B params / 8 devices = 15 GB.
    assert rows["stage1 step"]["peak_gb"] > 15
    # Stage 2 runs chosen + rejected rows: twice stage 1's tokens and FLOPs.
    assert rows["stage2 step"]["tokens"] == 2 * rows["stage1 step"]["tokens"] == 2 * 64 * 1024
    assert rows["stage2 step"]["flops"] == pytest.approx(2 * rows["stage1 step"]["flops"])
    # ~6 x params x tokens, + 1/3 for block remat's recompute (8x), + attention and the head;
    # Qwen2.5-7B multiplies 6.53B weights per token in its layers.
    assert 8 * 6.5e9 * 65536 < rows["stage1 step"]["flops"] < 8 * 6.5e9 * 65536 * 1.3
    assert "(the paper: ~10 h on 8 x A800)" in proc.stdout


def test_llama2_and_phi3_train_steps_fit_8x80gb():
    script = """
import sys
from ml_collections import config_flags
from jaxrag.pipeline.config import get_config_for
from jaxrag.plan.fit import measure, plan_devices
for family in ("llama", "phi3"):
    rows = measure(get_config_for(family, ""), plan_devices(8), "h100", 60.0, 0.1, 0.5, log=lambda *_: None,
                   only=("stage1 step", "stage2 step"))
    for r in rows:
        print(family, r.name, r.peak_gb, r.fits)
"""
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 " + PLAN_XLA_FLAGS}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith(("llama", "phi3"))]
    assert len(lines) == 4, proc.stdout
    for family, *name, peak, fits in lines:
        assert fits == "True" and 10 < float(peak) <= 0.9 * USABLE_GB, (family, name, peak)


def test_qwen_lora_stage1_fits_one_80gb_gpu():
    """LoRA rank 16 at the paper config's per-device batch (8) on one device: the stage-1 step
    fits 80 GB where full fine-tuning does not, and its FLOPs skip the frozen weights' gradients
    (3 passes with block remat, against full FT's 4)."""
    script = """
from jaxrag.pipeline.config import get_config_for
from jaxrag.plan.fit import measure, plan_devices
cfg = get_config_for("qwen2", "")
full = measure(cfg, plan_devices(1), "h100", 60.0, 0.1, 0.5, log=lambda *_: None, only=("stage1 step",))[0]
cfg.model.lora.rank = 16
lora = measure(cfg, plan_devices(1), "h100", 60.0, 0.1, 0.5, log=lambda *_: None, only=("stage1 step",))[0]
print("full", full.peak_gb, full.fits, full.flops)
print("lora", lora.peak_gb, lora.fits, lora.flops)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**ENV, "XLA_FLAGS": PLAN_XLA_FLAGS},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.startswith(("full", "lora"))}
    assert rows["full"][1] == "False" and float(rows["full"][0]) > 100  # f32 weights + Adam: 16 B x 7.6B
    assert rows["lora"][1] == "True" and float(rows["lora"][0]) <= 0.9 * USABLE_GB
    assert float(rows["lora"][2]) == pytest.approx(0.75 * float(rows["full"][2]))


def test_a_stand_in_cpu_plan_leaves_out_the_cpu_only_weight_copies():
    """Qwen2.5-7B with LoRA on one device: the routed decode step holds the merged bf16 weights
    and the KV cache, and nothing of their size more on an accelerator (measured on one H100:
    17.2 GB). XLA-CPU multiplies a float32 copy of every bf16 weight, live at once across the
    unrolled layers; the stand-in plan leaves those out beyond one layer's copy."""
    script = """
from jaxrag.pipeline.config import get_config_for
from jaxrag.plan.fit import measure, plan_devices
cfg = get_config_for("qwen2", "")
cfg.model.lora.rank = 16
for stand_in in (False, True):
    r = measure(cfg, plan_devices(1), "h100", 60.0, 0.1, 0.5, log=lambda *_: None,
                only=("routed decoding: decode step",), stand_in=stand_in)[0]
    print("row", stand_in, r.peak_gb)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**ENV, "XLA_FLAGS": PLAN_XLA_FLAGS},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu, stand_in = (float(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("row"))
    # bf16 weights of Qwen2.5-7B (7.62B params, the vocab padded for the SR-RAG tokens) and the
    # cache of 16 rows x 28 layers x K, V x 4 kv heads x 128 dims, by the formula
    weights = 2 * (7.616e9 + 2 * 3584 * 4)
    layer_copy = 4 * 6.53e9 / 28  # one layer's float32 copy
    assert weights / 1e9 < stand_in < (weights + 2.0e9 + layer_copy) / 1e9, stand_in
    assert cpu > stand_in + 20  # XLA-CPU still copies: else this correction has to go


def test_failures_name_the_settings_that_fit():
    rows = [Row("stage1 step", 70.0, 1e15, 65536, 796, 0.2, 20.0, False,
                ("--config.stage1.per_device_batch_size=4", "--config.model.remat=block")),
            Row("retriever encoder", 0.6, 3e12, 16384, 0, None, 3.0, True, ())]
    lines = failures(rows, USABLE_GB, 0.1, 8)
    assert lines == ["stage1 step: 70.0 GB per device > 54.0 GB usable; try --config.stage1.per_device_batch_size=4, "
                     "--config.model.remat=block, --devices=16 (more FSDP devices)"]


@pytest.mark.parametrize("backend, dtype, head_dim, window, lengths, want", [
    ("gpu", jnp.bfloat16, 128, None, (512, 512), "cudnn"),
    ("gpu", jnp.float16, 64, None, (512, 1024), "cudnn"),  # a prefill chunk after earlier ones
    ("gpu", jnp.float32, 128, None, (512, 512), "xla"),  # cuDNN's fused kernel is half precision only
    ("gpu", jnp.bfloat16, 256, None, (512, 512), "xla"),  # head dim above what every GPU generation supports
    ("gpu", jnp.bfloat16, 100, None, (512, 512), "xla"),  # not a multiple of 8
    ("gpu", jnp.bfloat16, 96, 2048, (512, 512), "xla"),  # sliding window: a mask cuDNN's kernel does not take
    ("gpu", jnp.bfloat16, 128, None, (1, 1024), "xla"),  # decode step: cuDNN refuses Q 1 (seen on an H100)
    ("gpu", jnp.bfloat16, 128, None, (511, 511), "xla"),  # odd lengths with a mask: refused in training
    ("tpu", jnp.bfloat16, 128, None, (512, 512), "xla"),
    ("cpu", jnp.bfloat16, 128, None, (512, 512), "xla"),
])
def test_attention_implementation(backend, dtype, head_dim, window, lengths, want):
    assert attention_implementation(backend, dtype, head_dim, window, *lengths) == want


def test_gpu_path_gets_the_causal_padding_segment_mask(monkeypatch):
    """As on a GPU in bf16: the fused path is asked for, and given the boolean mask that
    causality, padding and packed documents imply (checked against a numpy construction)."""
    from jaxrag.models.decoder import Decoder, DecoderConfig
    from flax import nnx

    cfg = DecoderConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    model = Decoder(cfg, nnx.Rngs(0))
    calls, real = [], jax.nn.dot_product_attention

    def spy(q, k, v, mask=None, implementation=None):
        calls.append((np.asarray(mask), implementation))
        return real(q, k, v, mask=mask, implementation="xla")

    monkeypatch.setattr(decoder_mod.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decoder_mod.jax.nn, "dot_product_attention", spy)
    segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    ids = jnp.asarray(np.arange(12).reshape(2, 6) % 64)
    with jax.disable_jit():
        model(ids, masks.positions_from_segments(jnp.asarray(segments)), jnp.asarray(segments > 0),
              segment_ids=jnp.asarray(segments))
    want = np.zeros((2, 1, 6, 6), bool)
    for b in range(2):
        for t in range(6):
            for s in range(6):
                # causal, real key, same document; and every query sees itself (no empty row)
                want[b, 0, t, s] = s == t or (s <= t and segments[b, s] > 0 and segments[b, s] == segments[b, t])
    assert len(calls) == 1 or len(calls) == cfg.num_layers  # one traced scan body, or each layer eagerly
    for mask, implementation in calls:
        assert implementation == "cudnn"
        np.testing.assert_array_equal(mask, want)


def test_a_workdir_keeps_its_fit_verdict_until_what_it_depends_on_changes(tmp_path, monkeypatch):
    """`W/fit.json`: a rerun of the same config skips the check; a changed setting (not
    `pipeline.*`), or no record, checks again; a failed check writes nothing."""
    from types import SimpleNamespace

    from jaxrag.errors import JaxragError
    from jaxrag.pipeline import run as run_mod
    from jaxrag.pipeline.config import paper_config

    checked = []
    monkeypatch.setattr(run_mod, "check_fit", lambda cfg: checked.append(cfg.stage1.lr))
    cfg = paper_config("qwen2")
    cfg.model.path = "/some/model"
    workdir, names, steps = tmp_path / "run", ["construct"], [SimpleNamespace(action="run")]
    run_mod.check_fit_before(cfg, workdir, names, steps)
    run_mod.check_fit_before(cfg, workdir, names, steps)
    cfg.pipeline.stop_after = "construct"
    run_mod.check_fit_before(cfg, workdir, names, steps)
    assert checked == [cfg.stage1.lr] and (workdir / "fit.json").is_file()
    cfg.stage1.lr = 1e-3
    run_mod.check_fit_before(cfg, workdir, names, steps)
    assert checked == [1e-5, 1e-3]
    run_mod.check_fit_before(cfg, workdir, names, [SimpleNamespace(action="skip")])  # nothing left to run
    assert checked == [1e-5, 1e-3]
    (workdir / "fit.json").write_text("[not a record")
    run_mod.check_fit_before(cfg, workdir, names, steps)
    assert checked == [1e-5, 1e-3, 1e-3]
    (workdir / "fit.json").unlink()

    def refuse(cfg):
        raise JaxragError("stage1 step: too big")
    monkeypatch.setattr(run_mod, "check_fit", refuse)
    with pytest.raises(JaxragError, match="too big"):
        run_mod.check_fit_before(cfg, workdir, names, steps)
    assert not (workdir / "fit.json").exists()


def test_the_fit_check_runs_on_cpu_against_host_memory(tiny_hf, monkeypatch):
    """The pipeline's preflight on a CPU backend: the run's programs, compiled at the dtypes the
    CPU runs, against host memory; too little refuses with the settings to change."""
    from jaxrag.errors import JaxragError
    from jaxrag.pipeline.config import paper_config
    from jaxrag.plan import fit as plan_fit

    _, hf_dir, _ = tiny_hf("qwen2")
    cfg = paper_config("qwen2")
    cfg.model.path, cfg.model.max_length = str(hf_dir), 64
    for section in (cfg.stage1, cfg.stage2):
        section.update(batch_size=4, per_device_batch_size=4)
    cfg.mesh.update(data=-1, fsdp=1)
    measured = {}
    real_measure = plan_fit.measure

    def spy(cfg, devices, *args, **kw):
        measured["dtype"], measured["devices"] = cfg.model.dtype, len(devices)
        measured["rows"] = real_measure(cfg, devices, *args, **kw)
        return measured["rows"]

    monkeypatch.setattr(plan_fit, "measure", spy)
    monkeypatch.setattr(plan_fit, "host_memory_gb", lambda: 64.0)
    plan_fit.check_fit(cfg)  # fits: nothing raised
    assert measured["dtype"] == "float32" and measured["devices"] == jax.device_count()
    smallest = min(r.peak_gb for r in measured["rows"])
    monkeypatch.setattr(plan_fit, "host_memory_gb", lambda: smallest / 2)
    with pytest.raises(JaxragError, match=r"would run out of host memory \(jaxrag.plan\):\n  stage1 step: .* GB per "
                                          r"device > .* GB usable; try --config.stage1.per_device_batch_size=2"):
        plan_fit.check_fit(cfg)


def test_the_encoder_program_is_the_configs_encoder():
    """The planned retriever encoder is the config's own (all-MiniLM-L6-v2 here: its weights'
    bytes, 6 layers at 256 tokens), and BERT-base at DPR's 256 tokens when the encoder is not on
    this machine."""
    from safetensors.numpy import load_file

    from jaxrag import sharding
    from jaxrag.models.encoder_io import default_encoder_path
    from jaxrag.pipeline.config import get_config_for
    from jaxrag.plan.programs import ENCODER, encoder_architecture, encoder_program

    cfg = get_config_for("qwen2", "tiny")
    assert cfg.retrieval.encoder == "minilm"
    program = encoder_program(cfg, sharding.make_mesh(cfg.mesh, jax.devices()[:1]))
    weights = load_file(str(default_encoder_path() / "model.safetensors"))
    want = sum(w.size * 4 for k, w in weights.items() if "pooler" not in k and "position_ids" not in k)
    assert program.read_bytes == want  # float32, no pooler (mean pooling)
    seq = json.loads((default_encoder_path() / "sentence_bert_config.json").read_text())["max_seq_length"]
    e, f, layers = 384, 1536, 6  # all-MiniLM-L6-v2's config.json
    assert program.tokens == 64 * seq
    assert program.flops == 2 * layers * (4 * e * e + 2 * e * f) * 64 * seq + 4 * layers * e * 64 * seq**2
    assert encoder_architecture("no-such-org/no-such-encoder") == (ENCODER, 256)


def test_calls_follow_the_configs_training_mixture():
    """The estimated hours count the config's training questions (`data.train_sizes`), not Table
    5's: 60 questions of the paper's Qwen recipe are one stage-1 step of 64 and 60 x 5 contexts
    of GenRead in batches of 64."""
    import math

    from jaxrag import sharding
    from jaxrag.pipeline.config import get_config_for
    from jaxrag.plan.programs import decoder_programs, plan_decoder_config, train_questions

    cfg = get_config_for("qwen2", "")
    assert train_questions(cfg) == 50_912  # Table 5
    cfg.data.train_sizes = {name: 10 for name in cfg.data.train_sizes}
    programs = {p.name: p for p in decoder_programs(cfg, plan_decoder_config(cfg), sharding.make_mesh(
        cfg.mesh, jax.devices()[:1]))}
    assert programs["stage1 step"].calls == int(cfg.stage1.epochs) * math.ceil(60 / int(cfg.stage1.batch_size)) == 1
    gen = math.ceil(60 * int(cfg.construct.n_contexts) / int(cfg.construct.generate_batch_size))
    assert programs["construct generation: decode step"].calls == gen * int(cfg.construct.verbalize_max_tokens)


def test_the_v4_and_the_devices_per_host_of_each_accelerator():
    assert ACCELERATORS["v4"] == (275e12, 1.2e12, 32.0)  # Google's bf16 peak, HBM bandwidth and size per chip
    assert DEVICES_PER_HOST == {"h100": 8, "a100": 8, "v4": 4, "v5e": 4, "v5p": 4}
    from types import SimpleNamespace
    kinds = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "NVIDIA A100-SXM4-80GB": "a100",
             "NVIDIA H100 80GB HBM3": "h100"}
    assert {k: accelerator_of(SimpleNamespace(device_kind=k)) for k in kinds} == kinds
    assert devices_per_process(16, 4) == 4 and devices_per_process(4, 8) == 4 and devices_per_process(1, 8) == 1
    from jaxrag.errors import JaxragError
    with pytest.raises(JaxragError, match="not a whole number of hosts of 8 devices"):
        devices_per_process(12, 8)


GENERATION_SCRIPT = """
import json, sys
import jax
from jaxrag import sharding
from jaxrag.pipeline.config import paper_config
from jaxrag.plan import fit
from jaxrag.plan.programs import pipeline_programs

def config(tensor):
    cfg = paper_config("qwen2")
    cfg.model.path, cfg.model.max_length, cfg.generation.tensor = sys.argv[1], 64, tensor
    return cfg

def say(**kw):
    print("out", json.dumps(kw), flush=True)

devices, decode = fit.plan_devices(4), ("routed decoding: decode step",)
mesh = sharding.make_mesh(config(0).mesh, devices)
for tensor in (1, 2):  # the routed decode step compiled on one process's 4 devices at each split
    gen = fit.generation_placement(config(tensor), devices, 1, 0)
    p = {p.name: p for p in pipeline_programs(config(tensor), mesh, gen.mesh)}[decode[0]]
    compiled = p.lower().compile()
    head = compiled.input_shardings[0][0]["lm_head"]
    say(tensor=tensor, mesh=dict(p.mesh.shape), args=compiled.memory_analysis().argument_size_in_bytes,
        head=head.shard_shape((64, 151680)), weights=gen.weight_gb)
# 0.075 GB per v4 "chip": 0.05 GB usable, the 0.039 GB model (bf16) split in two (its half <= 50%)
rows = fit.measure(config(0), devices, "v4", 0.075 * 0.75, 0.1, 0.5, log=lambda *_: None, only=decode, stand_in=True)
say(split=rows[0].mesh, fits=rows[0].fits)
rows = fit.measure(config(1), devices, "v4", 0.05 * 0.75, 0.1, 0.5, log=lambda *_: None, only=decode, stand_in=True)
say(whole=rows[0].mesh, failures=fit.failures(rows, 0.05 * 0.75, 0.1, 4))
# two processes of 2 devices share the calls: half the hours of one
one, two = (fit.measure(config(0), devices, "v4", 60.0, 0.1, 0.5, log=lambda *_: None,
                        only=("construct generation: decode step",),
                        generation=fit.generation_placement(config(0), devices[:2], n, 0))[0] for n in (1, 2))
say(hours=[one.hours, two.hours])
# the pipeline's preflight (CPU: host memory, the model whole) on this process's own devices
real, seen = fit.measure, {}
def only_decode(*args, **kw):
    gen_mesh = kw["generation"].mesh
    seen.update(mesh=dict(gen_mesh.shape), local=list(gen_mesh.devices.flat) == jax.local_devices())
    return real(*args, **kw, only=decode)
fit.measure, fit.host_memory_gb = only_decode, lambda: 0.0375
try:
    fit.check_fit(config(0))
except Exception as e:
    seen["refused"] = str(e)
say(**seen)
"""


def test_generation_is_planned_on_one_process_devices_split_as_far_as_it_must(tiny_hf):
    """The routed decode step of a 39 MB model (bf16 weights, as generation loads them) on 4 fake
    devices of one process: split over `tensor` 2, each device holds half the weights (the head
    split by vocab), the other factor of 2 on data; little memory picks that split, less refuses
    with the setting to change (`--config.generation.tensor=2`), in the plan and in the
    pipeline's preflight."""
    _, hf_dir, _ = tiny_hf("qwen2")
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=4 " + PLAN_XLA_FLAGS}
    proc = subprocess.run([sys.executable, "-c", GENERATION_SCRIPT, str(hf_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("out ")]
    whole, split, chosen, refused, hours, preflight = out
    assert whole["mesh"] == dict(data=4, fsdp=1, tensor=1) and whole["head"] == [64, 151680]
    assert split["mesh"] == dict(data=2, fsdp=1, tensor=2) and split["head"] == [64, 151680 // 2]
    assert 0.45 < split["args"] / whole["args"] < 0.6, (split, whole)  # weights and KV cache halved
    assert whole["args"] > whole["weights"] * 1e9
    assert chosen == dict(split=dict(data=2, fsdp=1, tensor=2), fits=True)
    assert refused["whole"] == dict(data=4, fsdp=1, tensor=1)
    assert len(refused["failures"]) == 1 and refused["failures"][0].startswith(
        "routed decoding: decode step: "), refused
    assert "(data 4 x tensor 1) > 0.0 GB usable; try --config.generation.tensor=2, --config.inference.batch_size=" \
        in refused["failures"][0] and "--devices" not in refused["failures"][0]
    assert hours["hours"][1] == pytest.approx(hours["hours"][0] / 2)
    assert preflight["mesh"] == dict(data=4, fsdp=1, tensor=1) and preflight["local"]
    assert "would run out of host memory (jaxrag.plan):\n  routed decoding: decode step: " in preflight["refused"]
    assert "try --config.generation.tensor=2" in preflight["refused"]
