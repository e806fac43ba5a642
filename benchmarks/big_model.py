"""From a checkpoint to a mesh at the largest size this machine holds: a random-weight Llama of
1.56B parameters (3.12 GB of bfloat16 safetensors in five shards, tests/support/big_llama.py),
converted, loaded onto a data=1,model=8 mesh of 8 simulated CPU devices, and decoded. Each step
runs in its own process under `/usr/bin/time -v`, whose peak resident memory is what it reports.

    python benchmarks/big_model.py [--work build] [--output benchmarks/results/DATE_big-model.jsonl]

Steps: `convert` (jspec convert SRC OUT), `load-1` (jspec.load on one device), `load-8` (onto the
mesh: the largest share any device holds), `decode-8` (load, then 4 greedy tokens on the mesh).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a step's child process runs after the load: the devices' shares, then optionally a decode.
CHILD = """
import json, sys, time
import jax, jspec
mesh = None if sys.argv[2] == "1" else f"data=1,model={sys.argv[2]}"
t = time.perf_counter()
m = jspec.load(sys.argv[1], mesh=mesh)
jax.block_until_ready(m.params)
shares = {}
for x in jax.tree.leaves(m.params):
    for s in x.addressable_shards:
        shares[s.device.id] = shares.get(s.device.id, 0) + s.data.nbytes
total = sum(x.nbytes for x in jax.tree.leaves(m.params))
out = {"load_s": round(time.perf_counter() - t, 2), "param_bytes": total,
       "largest_device_share": round(max(shares.values()) / total, 4)}
if sys.argv[3] == "decode":
    [r] = m.generate([{"token_ids": [1, 17, 923, 4051, 77]}], max_new_tokens=4)
    out.update(new_tokens=r["new_tokens"], decode_s=round(r["seconds"], 2))
print("RESULT", json.dumps(out))
"""


def timed(command: list[str], env: dict) -> tuple[dict, int]:
    """(the RESULT line's JSON or {}, peak resident bytes) of one child process."""
    p = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    found = [line.split(" ", 1)[1] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(found[0]) if found else {}), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=str(ROOT / "build"), help="where the checkpoint and its conversion go")
    p.add_argument("--output", default=str(ROOT / f"benchmarks/results/{datetime.date.today()}_big-model.jsonl"))
    args = p.parse_args()
    work = Path(args.work)
    source, converted = work / "big-llama", work / "big-llama-converted"
    if not (source / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tests/support/big_llama.py"), str(source)], check=True)
    checkpoint = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    shutil.rmtree(converted, ignore_errors=True)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    jspec = str(Path(sys.executable).with_name("jspec"))
    rows = []
    _, peak = timed([jspec, "convert", str(source), str(converted)], env)
    rows.append({"step": "convert", "peak_bytes": peak})
    for step, devices, decode in (("load-1", "1", "no"), ("load-8", "8", "no"), ("decode-8", "8", "decode")):
        result, peak = timed([sys.executable, "-c", CHILD, str(converted), devices, decode], env)
        rows.append({"step": step, "peak_bytes": peak, **result})
    with open(args.output, "w") as f:
        for row in rows:
            f.write(json.dumps({"checkpoint_bytes": checkpoint, **row}) + "\n")
    print(f"checkpoint: {checkpoint / 1e9:.2f} GB ({source})\n")
    print("| step | peak host memory | vs checkpoint | largest device share | seconds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        share = f"{r['largest_device_share']:.3f}" if "largest_device_share" in r else "-"
        seconds = r.get("decode_s", r.get("load_s", "-"))
        print(f"| {r['step']} | {r['peak_bytes'] / 1e9:.2f} GB | {r['peak_bytes'] / checkpoint:.2f}x | {share} | {seconds} |")
    print(f"\n[{len(rows)} rows in {args.output}]")


if __name__ == "__main__":
    main()
