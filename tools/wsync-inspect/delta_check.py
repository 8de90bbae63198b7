"""ctest tool.inspect_delta: `wsync-inspect NEW --delta-from BASE` against counts made here.

BASE is a random tiny Qwen3 checkpoint (wsync-model-gen); NEW is a copy in which this script flips
one byte of elements 97k and 97k + 1 of two tensors, counting the elements it changed. The tool must
report exactly those changed elements per class and in total, a delta smaller than the full bytes,
nothing changed between BASE and itself, and refuse (exit 1, naming the tensor) a NEW that lacks a
tensor of BASE (model.norm.weight renamed). Pure Python (struct, json), no numpy.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

bin_dir = sys.argv[1]
work = tempfile.mkdtemp(prefix="inspect-delta-")
base, new, short = (os.path.join(work, d) for d in ("base", "new", "short"))
subprocess.run([f"{bin_dir}/wsync-model-gen", "--arch", "qwen3", "--preset", "tiny", "--seed", "3", "--out", base],
               check=True, stdout=subprocess.DEVNULL)
shutil.copytree(base, new)
files = sorted(f for f in os.listdir(new) if f.endswith(".safetensors"))
path = os.path.join(new, files[0])
with open(path, "rb") as f:
    raw = bytearray(f.read())
(hlen,) = struct.unpack_from("<Q", raw, 0)
header = json.loads(raw[8:8 + hlen])
sizes = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
names = sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "BF16")[:2]
changed = 0
for name in names:
    t = header[name]
    item = sizes[t["dtype"]]
    lo, hi = t["data_offsets"]
    n = (hi - lo) // item
    for i in range(0, n, 97):
        for j in (i, i + 1)[: 2 if i + 1 < n else 1]:  # pairs of neighbours: one run, two elements
            raw[8 + hlen + lo + j * item] ^= 0x01
            changed += 1
with open(path, "wb") as f:
    f.write(raw)


def stats(a, b):
    out = subprocess.run([f"{bin_dir}/wsync-inspect", b, "--delta-from", a, "--json"], capture_output=True, text=True)
    return out.returncode, out.stdout, out.stderr


rc, out, err = stats(base, new)
assert rc == 0, err
classes = json.loads(out)["classes"]
assert classes["total"]["changed_items"] == changed, (classes["total"], changed)
assert classes["bf16"]["changed_items"] == changed, classes["bf16"]
assert classes["total"]["delta_bytes"] < classes["total"]["full_bytes"] // 10, classes["total"]
rc, out, err = stats(base, base)
assert rc == 0 and json.loads(out)["classes"]["total"]["changed_items"] == 0, out
shutil.copytree(base, short)
renamed = os.path.join(short, files[0])  # model.norm.weight renamed in place (same length): gone from `short`
with open(renamed, "rb") as f:
    raw = f.read()
assert raw.count(b'"model.norm.weight"') == 1
with open(renamed, "wb") as f:
    f.write(raw.replace(b'"model.norm.weight"', b'"model.norX.weight"'))
rc, out, err = stats(base, short)
assert rc == 1 and "model.norm.weight is in" in err and "but not in" in err, (rc, err)
shutil.rmtree(work)
print(f"inspect delta: ok ({changed} elements changed, all found)")
