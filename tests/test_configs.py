"""configs/*.py: the paper's hyperparameters, the tiny default, command-line overrides."""

import importlib.util
from pathlib import Path

import jax
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from jaxrag.errors import JaxragError
from jaxrag.models.decoder import Decoder, DecoderConfig

CONFIGS = Path(__file__).parent.parent / "configs"
PAPER = {"qwen": ("Qwen/Qwen2.5-7B-Instruct", 11, 0.2), "llama2": ("meta-llama/Llama-2-7b-chat-hf", 15, 0.1),
         "phi3": ("microsoft/Phi-3.5-mini-instruct", 15, 0.2)}


def _load(name):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_setup(name):
    cfg = _load(name).get_config()
    path, layer, tau = PAPER[name]
    assert (cfg.model.path, cfg.model.datastore_layer, cfg.inference.tau) == (path, layer, tau)
    assert (cfg.stage1.batch_size, cfg.stage1.lr, cfg.stage1.epochs) == (64, 1e-5, 1)
    assert (cfg.stage2.lr, cfg.stage2.dpo_beta, cfg.stage2.epochs) == (5e-7, 0.3, 1)
    assert (cfg.construct.n_contexts, cfg.construct.verbalize_max_tokens, cfg.inference.k) == (5, 150, 30)
    assert cfg.model.sources == ["wiki", "self"]


@pytest.mark.parametrize("name", sorted(PAPER))
def test_tiny_is_cpu_sized(name):
    cfg = _load(name).get_config("tiny")
    assert cfg.model.path == "" and cfg.model.arch.hidden_size <= 512
    with pytest.raises(JaxragError, match="unknown config size"):
        _load(name).get_config("huge")


def test_command_line_override():
    argv = ["prog", f"--config={CONFIGS / 'qwen.py'}:tiny", "--config.stage1.lr=0.5", "--config.inference.k=7"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
    fv(argv)
    assert fv.config.stage1.lr == 0.5 and fv.config.inference.k == 7 and fv.config.model.family == "qwen2"


def test_every_parameter_has_logical_axis_names():
    cfg = DecoderConfig(family="qwen2", vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=4, qkv_bias=True, o_bias=True)
    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    # embed, lm_head, final norm; 8 attention + 3 mlp + 2 norms, each stacked over the layers
    assert len(leaves) == 3 + 13
    names = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm"}
    stacked = 0
    for var in leaves:
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == len(var.shape) and set(axes) <= names | {"layers"}
        if "layers" in axes:
            assert axes[0] == "layers" and var.shape[0] == cfg.num_layers and axes.count("layers") == 1
            stacked += 1
    assert stacked == 13
