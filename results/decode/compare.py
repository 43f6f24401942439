"""Two runs of the miniature pipeline compared: `python results/decode/compare.py A B` reads the
workdirs /tmp/i53/run-A and /tmp/i53/run-B (written by the command in README.md) and prints every
results.json leaf that differs (timings aside), which stage files are identical, then the leaves
that differ beyond float32 rounding and the datastore keys' largest difference."""
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from pipeline_fixtures import without_timings  # noqa: E402


def leaves(x, y, path=""):
    """(path, x, y) for every leaf both trees hold; ("only in one", path) for keys one lacks."""
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if k in x and k in y:
                yield from leaves(x[k], y[k], f"{path}/{k}")
            else:
                yield "only in one", f"{path}/{k}", None
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            yield from leaves(u, v, f"{path}[{i}]")
    else:
        yield path, x, y


def rounding(x, y) -> bool:
    """Equal, both NaN, or floats within float32 rounding."""
    if isinstance(x, float) and isinstance(y, (int, float)):
        return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-9)
    return x == y


def digests(root: Path, sub: str) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((root / sub).rglob("*")) if f.is_file()}


a, b = (Path(f"/tmp/i53/run-{c}") for c in sys.argv[1:3])
ra, rb = (without_timings(json.loads((w / "results.json").read_text())) for w in (a, b))
pairs = list(leaves(ra, rb))
for path, x, y in pairs:
    if path == "only in one":
        print("only in one:", x)
    elif x != y:
        print("differs:", path, str(x)[:80], "|", str(y)[:80])
print("results.json equal (timings aside):", ra == rb)
for sub in ("construct", "datastore", "world", "base", "stage1", "stage2", "baselines"):
    fa, fb = digests(a, sub), digests(b, sub)
    differ = [k for k in fa if fb.get(k) != fa[k]]
    print(f"{sub}: {len(fa) - len(differ)} of {len(fa)} files identical; differing: {differ[:8]}")

print("\n--- beyond float32 rounding (rel 1e-5), NaN == NaN ---")
compared = [(p, x, y) for p, x, y in pairs if p != "only in one"]
beyond = [(p, x, y) for p, x, y in compared if not rounding(x, y)]
for path, x, y in beyond:
    print("differs:", path, str(x)[:80], "|", str(y)[:80])
print(f"{len(beyond)} of {len(compared)} leaves differ beyond rounding")
for f in sorted((a / "datastore").glob("*.bin")):
    x, y = np.fromfile(f, np.float32), np.fromfile(b / "datastore" / f.name, np.float32)
    print(f, "max |diff|", np.abs(x - y).max(), "max |x|", np.abs(x).max())
