"""Two `jspec bench` results files, row by row (method, batch size, question): the rows whose
tokens or mean accepted tokens differ, and the lossless rows not identical to `ar`. Used to check
that a restructuring changed no output (docs/journal/2026-12-02_the-house-rerun.md).

    python benchmarks/probes/compare_runs.py OLD.jsonl NEW.jsonl
"""
import json, sys, re
def load(p):
    out = {}
    for l in open(p):
        r = json.loads(l)
        m = re.sub(r"draft_model=[^;,]*", "draft_model=D", r["method"])
        out[(m, r["batch_size"], r["id"])] = r
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
print("rows", len(a), len(b), "keys equal", a.keys() == b.keys())
tok = acc = 0
for k in sorted(a.keys() & b.keys(), key=str):
    x, y = a[k], b[k]
    if x.get("token_ids") != y.get("token_ids"):
        tok += 1; print("tokens differ", k)
    if x.get("mean_accepted_tokens") != y.get("mean_accepted_tokens"):
        acc += 1; print("accepted differ", k, x.get("mean_accepted_tokens"), y.get("mean_accepted_tokens"))
    if x.get("same_as_ar") != y.get("same_as_ar"):
        print("same_as_ar differ", k, x.get("same_as_ar"), y.get("same_as_ar"))
lossless_bad = [k for k, r in b.items() if r.get("kind") == "lossless" and r.get("same_as_ar") is False]
print("token mismatches", tok, "accepted mismatches", acc, "lossless rows not same as ar:", lossless_bad)
