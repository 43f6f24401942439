import os

# Tests run on CPU in float32; multi-device tests set their own XLA_FLAGS in a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
