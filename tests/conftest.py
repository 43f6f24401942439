import os

# Tests run on CPU in float32; multi-device tests set their own XLA_FLAGS in a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One persistent XLA compilation cache per checkout, shared by both xdist workers and every
# subprocess a test starts: the pipeline tests run the same miniature pipeline several times
# (3 min cold, 70 s warm, same results). Unbounded, so without jax's LRU eviction: that keeps an
# access-time file beside each entry, and a process killed between writing the two (the kill -9
# tests) left an entry without one, after which every process's writes failed and the rest of the
# suite compiled everything cold. An entry read while another process writes it is a miss, not
# an error (jax warns and compiles).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# GGUF conversions (`jaxrag.models.gguf.converted`) likewise, per checkout: a fresh clone converts
# SmolLM2 once (the real path's first process), and never into the user's own cache.
os.environ.setdefault("JAXRAG_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jaxrag"))

from jaxrag.pipeline.cli import reuse_cpu_temporaries  # noqa: E402

reuse_cpu_temporaries()  # as `python -m jaxrag.train` does: before jax loads (trainer tests ~20% faster)

from pipeline_fixtures import MINI_XLA_FLAGS  # noqa: E402

import pytest  # noqa: E402

pytest_plugins = ["cpu_seconds"]


def pytest_configure(config):
    """The suite's programs (tiny models) run for far less time than they take to compile, so its
    workers and the subprocesses they start compile them as the miniature pipeline's runs do,
    without LLVM's optimizations (five in-worker modules: 40% less CPU, results/ci). Set here, in
    the process that starts the workers, before they start (they inherit it) and before any test
    module loads; a test that starts a process with flags of its own sets them whole. CI's step
    (`-m ci_step`: SmolLM2, whose programs run longer than they compile) keeps XLA's default."""
    if "PYTEST_XDIST_WORKER" not in os.environ and config.option.markexpr.split() != ["ci_step"]:
        os.environ.setdefault("XLA_FLAGS", MINI_XLA_FLAGS)


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


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory):
    """(workdir, executed notebook) of the miniature pipeline run by the quickstart notebook, once
    per session for every module and worker (tests/pipeline_fixtures.py: quickstart_run)."""
    from pipeline_fixtures import quickstart_run

    return quickstart_run(tmp_path_factory)


# The longest modules start first: with `--dist loadfile` a module runs whole on one worker, in
# collection order, so one that starts last leaves the other worker idle while it runs. The
# suite's two share the quickstart's run: test_pipeline.py builds it first thing while
# test_multihost.py runs its 2-process launches, which compare with it only at their end. In CI's
# step (`-m ci_step`), the real path's 2-process run starts first, the real-model modules beside it.
LONGEST_FIRST = ("test_real_path.py", "test_multihost.py", "test_pipeline.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _release_host_memory():
    """Gives the module's freed heap back to the OS once it is done. The allocator above never
    trims by itself, so without this a worker keeps the high-water mark of every module it ran
    (~10 GB by the end of the suite), beside a subprocess pipeline of its own on the other worker."""
    yield
    from jaxrag.runtime import host_memory

    host_memory.release()


def pytest_terminal_summary(terminalreporter):
    """Lines a test or fixture recorded for CI's log (`user_properties` named "ci_log", which xdist
    carries from its workers): the real path's stage seconds per process, so that the next slowdown
    shows in CI's own output."""
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, value in getattr(report, "user_properties", ()):
                if name == "ci_log" and getattr(report, "when", "") in ("setup", "call"):
                    terminalreporter.write_line(value)
