"""Two runs of the miniature pipeline compared: `python compare.py A B` reads /tmp/i53/run-A and
/tmp/i53/run-B (written by the loop in README.md) and prints every results.json leaf that differs
(timings aside), then those beyond float32 rounding, and which stage files are identical."""
import hashlib, json, sys
from pathlib import Path
sys.path.insert(0, "/work/main/tests")
from pipeline_fixtures import without_timings

a, b = (Path(f"/tmp/i53/run-{c}") for c in sys.argv[1:3])
ra, rb = (without_timings(json.loads((w / "results.json").read_text())) for w in (a, b))

def diff(x, y, path=""):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if k not in x or k not in y:
                print("only in one:", path + "/" + k); continue
            diff(x[k], y[k], path + "/" + k)
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            diff(u, v, f"{path}[{i}]")
    elif x != y:
        print("differs:", path, str(x)[:80], "|", str(y)[:80])

diff(ra, rb)
print("results.json equal (timings aside):", ra == rb)
for sub in ("construct", "datastore", "world", "base", "stage1", "stage2", "baselines"):
    fa = {str(f.relative_to(a)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((a / sub).rglob("*")) if f.is_file()}
    fb = {str(f.relative_to(b)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((b / sub).rglob("*")) if f.is_file()}
    same = [k for k in fa if fb.get(k) == fa[k]]
    print(f"{sub}: {len(same)} of {len(fa)} files identical; differing: {[k for k in fa if fb.get(k) != fa[k]][:8]}")

print("\n--- beyond float32 rounding (rel 1e-5), NaN == NaN ---")
import math
n = [0, 0]
def close(x, y, path=""):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) & set(y)):
            close(x[k], y[k], path + "/" + k)
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            close(u, v, f"{path}[{i}]")
    elif isinstance(x, float) and isinstance(y, (int, float)):
        n[0] += 1
        if not (math.isnan(x) and math.isnan(y)) and not math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-9):
            n[1] += 1; print("differs:", path, x, y)
    else:
        n[0] += 1
        if x != y:
            n[1] += 1; print("differs:", path, str(x)[:80], "|", str(y)[:80])
close(ra, rb)
print(f"{n[1]} of {n[0]} leaves differ beyond rounding")
import numpy as np
for sub in ("datastore",):
    for f in sorted((a / sub).glob("*")):
        if f.suffix == ".bin":
            x, y = np.fromfile(f, np.float32), np.fromfile(b / sub / f.name, np.float32)
            print(f, "max |diff|", np.abs(x - y).max(), "max |x|", np.abs(x).max())
