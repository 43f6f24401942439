"""Seconds of generate()'s first call (trace + compile + run) and of a warm call, on benchmarks.decode's
random float32 Qwen2 (benchmarks.common.ARCH: 8 layers), a 128-token prompt and 64 new tokens: the
inference programs' compile time. Run twice per commit with one JAX_COMPILATION_CACHE_DIR (and
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0): the first process compiles, the second finds every
program in the persistent cache. `PYTHONPATH=. python compile_time.py LABEL` from a checkout's root."""
import json
import sys
import time

import numpy as np

from benchmarks.common import ARCH
from benchmarks.decode import make_models
from jaxrag.decode.sampler import generate

peer, dec = make_models(ARCH, 192)
out = {}
for batch in (1, 16):
    prompts = np.random.default_rng(0).integers(0, ARCH["vocab"], (batch, 128)).tolist()
    t = time.perf_counter(); generate(dec, prompts, 64); first = time.perf_counter() - t
    t = time.perf_counter(); generate(dec, prompts, 64); warm = time.perf_counter() - t
    out[batch] = {"first_s": round(first, 2), "warm_s": round(warm, 2), "compile_s": round(first - warm, 2)}
import jaxrag
print(sys.argv[1], jaxrag.__file__, json.dumps(out), flush=True)
