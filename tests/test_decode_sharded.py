"""Sharded decoding on 8 fake CPU devices equals single-device decoding, through the generation
engine and the server's too (subprocess, because the device count is fixed when jax starts)."""

import os
import subprocess
import sys
from pathlib import Path


def test_greedy_generation_is_the_same_on_every_mesh(tiny_hf):
    _, hf_dir, _ = tiny_hf("qwen2")
    script = Path(__file__).with_name("sharded_decode_check.py")
    proc = subprocess.run([sys.executable, str(script), str(hf_dir)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{script.parent}{os.pathsep}{script.parent.parent}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded generation ok" in proc.stdout and "sharded routing ok" in proc.stdout
    assert "sharded engine ok" in proc.stdout
    assert "generation placement ok" in proc.stdout and "slot pool placement ok" in proc.stdout
    assert "served placement ok" in proc.stdout
