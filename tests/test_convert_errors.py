"""Bad input to `jaxrag.convert`: one clear line naming the file, exit 2, nothing at --out."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from hf_fixtures import make_hf_model
from jaxrag import convert


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "hf"
    make_hf_model(out, "llama")
    return out


def _drop_tensor(d):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")


def _wrong_shape(d):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    save_file(tensors, d / "model.safetensors")


def _truncate(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _set_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **kw}))


BREAKAGES = {
    "missing directory": (lambda d: shutil.rmtree(d), "no such directory"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "missing tensor": (_drop_tensor, "model.layers.1.mlp.up_proj.weight' is missing"),
    "wrong shape": (_wrong_shape, "model.norm.weight' has shape (63,), expected (64,)"),
    "truncated": (_truncate, "truncated or corrupt"),
    "malformed config": (lambda d: (d / "config.json").write_text('{"model_type": "llama",'), "malformed JSON"),
    "unknown architecture": (lambda d: _set_config(d, model_type="gpt2"), "model_type 'gpt2' is not supported"),
    "no tokenizer": (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
                     "no tokenizer files"),
}
FILE_NAMED = {"no weights": "hf", "missing directory": "hf", "no tokenizer": "hf", "malformed config": "config.json",
              "unknown architecture": "config.json"}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_bad_input_is_refused_cleanly(case, good_dir, tmp_path, capsys):
    broken = tmp_path / "hf"
    shutil.copytree(good_dir, broken)
    breakage, message = BREAKAGES[case]
    breakage(broken)
    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_info:
        convert.main(["--hf", str(broken), "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert message in err and FILE_NAMED.get(case, "model.safetensors") in err, err
    assert not out.exists() and not any(p.name.startswith(".ckpt") for p in tmp_path.iterdir())


def test_cli_process_prints_no_traceback(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jaxrag.convert", "--hf", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "no such directory" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten(good_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(SystemExit):
        convert.main(["--hf", str(good_dir), "--out", str(out)])
    assert "already exists" in capsys.readouterr().err
