import os

# Tests run on CPU in float32; multi-device tests set their own XLA_FLAGS in a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """variant -> (torch reference, HF dir, jaxrag Model), built once per session and shared, so
    the jitted programs compile once for every test module that uses them."""
    import jaxrag
    from hf_fixtures import make_hf_model

    cache = {}

    def get(variant):
        if variant not in cache:
            out = tmp_path_factory.mktemp(variant)
            ref = make_hf_model(out, variant)
            cache[variant] = (ref, out, jaxrag.load_model(out))
        return cache[variant]

    return get
