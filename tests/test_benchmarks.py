"""The peer benchmarks at toy sizes: each writes the JSON keys its issue names, and the checks
inside them hold against their references (greedy tokens == transformers' teacher-forced argmax,
exact search == numpy's top 10). Speed itself is never asserted here (see benchmarks/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import transformers

from benchmarks import attention, decode, fit, retrieval, train

REPO = Path(__file__).resolve().parents[1]
TOY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
       "--vocab", "256"]


def test_decode_writes_the_contract_and_matches_transformers(tmp_path):
    out = tmp_path / "decode.json"
    result = decode.main(["--json", str(out), *TOY, "--prompt", "8", "--new", "6", "--batches", "1,3",
                          "--repeats", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for row in result["results"]:
        assert {"batch", "jaxrag_tok_s", "hf_tok_s", "identical", "step_bytes_accessed", "step_argument_bytes",
                "bytes_ratio"} <= set(row)
        assert row["identical"] and row["teacher_forced_match"] == 1.0
        assert row["jaxrag_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["bytes_ratio"] == round(row["step_bytes_accessed"] / row["step_argument_bytes"], 4)


def test_train_writes_the_contract(tmp_path):
    out = tmp_path / "train.json"
    result = train.main(["--json", str(out), *TOY, "--batch", "4", "--seq", "16", "--steps", "1", "--rounds", "1"])
    assert json.loads(out.read_text())["jaxrag_tok_s"] == result["jaxrag_tok_s"] > 0
    assert result["torch_tok_s"] > 0 and 0 < result["peak_fraction"] < 1
    # PaLM's count for this config: 6 x matmul params + 12 x layers x heads x head_dim x seq
    e, layers, heads, kv, hd, inter, vocab = 64, 2, 4, 2, 16, 128, 256
    params = layers * (e * heads * hd + 2 * e * kv * hd + heads * hd * e + 3 * e * inter) + e * vocab
    assert result["flops_per_token"] == 6 * params + 12 * layers * heads * hd * 16


def test_attention_check_measures_bf16_against_float32(tmp_path):
    """On CPU both paths are XLA: the check still compares bf16 with a float32 reference, so its
    errors are bf16-sized and nonzero, padding rows get no gradient, and the decoder agrees."""
    out = tmp_path / "attention.json"
    result = attention.main(["--json", str(out), *TOY, "--batch", "2", "--seq", "16", "--repeats", "1"])
    assert json.loads(out.read_text())["pass"] is result["pass"] is True
    assert set(result["cases"]) == {f"{c}_head{d}" for c in ("train_left_padded", "train_packed", "prefill_chunk",
                                                             "decode_step") for d in (16, 128)}
    for row in result["cases"].values():
        assert row["implementation"] == "xla" and row["fused"]["finite"]
        assert all(0 < e < 0.03 for e in row["xla"]["rel_err"].values())
    assert result["cases"]["decode_step_head16"]["t"] == 1
    assert result["decoder"] == {"logits_rel_err": 0.0, "grad_rel_err": 0.0, "generate_same": 1.0}


def test_retrieval_writes_the_contract_and_exact_search_is_exact(tmp_path):
    out = tmp_path / "retrieval.json"
    result = retrieval.main(["--n", "3000", "--dim", "32", "--queries", "64", "--clusters", "50",
                             "--intrinsic-dim", "8", "--repeats", "1", "--encoder-passages", "8",
                             "--datastore-keys", "400", "--json", str(out)])
    assert {"n", "dim", "recall_at_10", "scann_qps", "exact_qps", "build_s", "index_bytes"} <= set(result)
    assert (result["n"], result["dim"]) == (3000, 32)
    assert result["exact_recall_at_10"] == 1.0 and result["recall_at_10"] >= 0.9
    assert result["encoder"]["passages"] == 8 and result["datastore"]["keys"] == 400
    assert json.loads(out.read_text())["index_bytes"] == result["index_bytes"] > 0


def test_recall_counts_ties_and_duplicates_once():
    import numpy as np

    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32)  # rows 0 and 1 tie
    q = np.array([[1.0, 0.0]], np.float32)
    kth = retrieval.brute_force_kth(x, q, 1)
    assert retrieval.recall_at_k(x, q, np.array([[1]]), kth) == 1.0  # either tied row is right
    assert retrieval.recall_at_k(x, q, np.array([[2]]), kth) == 0.0
    kth2 = retrieval.brute_force_kth(x, q, 2)
    assert retrieval.recall_at_k(x, q, np.array([[0, 0]]), kth2) == 0.5  # a duplicate counts once


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    for args in (["benchmarks.decode", "--json", str(tmp_path / "no" / "x.json")],
                 ["benchmarks.train", "--json", str(tmp_path / "x.json"), "--heads", "3"],
                 ["benchmarks.retrieval", "--n", "0", "--json", str(tmp_path / "x.json")],
                 ["benchmarks.fit", "--config", "configs/qwen.py", "--json", str(tmp_path / "no" / "x.json")],
                 ["benchmarks.serve", "--json", str(tmp_path / "x.json"), "--fractions", "0.7,fast"],
                 ["benchmarks.serve", "--json", str(tmp_path / "x.json"), "--max-tokens", "9,2"],
                 ["benchmarks.serve", "--json", str(tmp_path / "x.json"), "--questions", str(tmp_path / "none.jsonl")],
                 ["benchmarks.eval", "--json", str(tmp_path / "no" / "x.json")],
                 ["benchmarks.construct", "--json", str(tmp_path / "x.json"), "--baseline", "no-such-commit"],
                 ["benchmarks.eval", "--json", str(tmp_path / "x.json"), "--baseline", "no-such-commit"]):
        proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert "error:" in proc.stderr


def test_fit_makes_arguments_of_the_abstract_shapes_dtypes_and_shardings():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    args = ({"w": jax.ShapeDtypeStruct((3, 4), jax.numpy.bfloat16, sharding=rows)},
            jax.ShapeDtypeStruct((2, 5), bool, sharding=rows), jax.ShapeDtypeStruct((4,), np.int32, sharding=rows))
    made = fit.materialize(args, seed=0)
    assert jax.tree.structure(made) == jax.tree.structure(args)
    for x, a in zip(jax.tree.leaves(made), jax.tree.leaves(args)):
        assert (x.shape, x.dtype, x.sharding) == (a.shape, a.dtype, a.sharding)
    w = np.asarray(made[0]["w"], np.float32)
    assert np.abs(w).max() <= 0.0201 and len(np.unique(w)) > 6  # varied, small like initial weights
    assert np.asarray(made[1]).all() and not np.asarray(made[2]).any()  # every position real; ids 0
    assert not np.array_equal(np.asarray(fit.materialize(args, seed=1)[0]["w"], np.float32), w)


def test_fit_runs_each_program_in_a_process_of_its_own(tmp_path):
    """A small Llama on the paper config's programs: each named program compiled and called, an
    unknown name recorded as its own error, the JSON written; CPUs have no allocator peak."""
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "llama")
    out = tmp_path / "fit.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fit", "--config", "configs/llama2.py",
                           f"--config.model.path={tmp_path / 'llama'}", "--config.stage2.batch_size=8",
                           "--config.model.max_length=128", "--only", "DPO reference scoring,nope", "--steps", "1",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    ran, bad = result["programs"]
    assert result["backend"] == "cpu" and ran["name"] == "DPO reference scoring"
    assert ran["tokens"] == 2 * 8 * 128  # chosen + rejected rows of one micro-batch of 8 pairs
    assert ran["xla_peak_gb"] > 0 and ran["seconds"] > 0 and ran["compile_s"] > 0
    assert ran["measured_peak_gb"] is None and ran["mfu"] is None
    assert ran["tflops_per_s"] == ran["flops"] / ran["seconds"] / 1e12
    # what one call reads: every float32 weight once (transformers counts them), the vocabulary
    # grown by the four SR-RAG tokens and padded to a multiple of 128 (512 + 4 -> 640)
    grown = transformers.LlamaConfig.from_pretrained(tmp_path / "llama", vocab_size=640)
    n_params = transformers.LlamaForCausalLM(grown).num_parameters()
    assert ran["read_bytes"] == 4 * n_params
    assert ran["read_tb_s"] == ran["read_bytes"] / ran["seconds"] / 1e12 and ran["hbm_fraction"] is None
    assert bad["name"] == "nope" and "no program 'nope'" in bad["error"]


def test_sampling_writes_the_contract_and_keeps_transformers_tokens(tmp_path):
    from benchmarks import sampling

    out = tmp_path / "sampling.json"
    result = sampling.main(["--json", str(out), "--rows", "4", "--vocab", "3000", "--repeats", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["case"] for r in result["results"]] == ["seakr", "genread", "temperature"]
    for row in result["results"]:
        assert row["same_kept_tokens"] and row["jaxrag_ms"] > 0 and row["hf_ms"] > 0
    kept = [r["mean_kept_tokens"] for r in result["results"]]
    assert kept[0] <= 50 and kept[1] < 3000 == kept[2]  # top-k 50; a nucleus; everything
