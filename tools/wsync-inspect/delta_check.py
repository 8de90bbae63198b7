"""ctest tool.inspect_delta: `wsync-inspect NEW --delta-from BASE` against counts made here.

BASE is a random tiny Qwen3 checkpoint (wsync-model-gen); NEW is a copy in which this script flips
one byte of elements 97k and 97k + 1 of two tensors, counting the elements it changed. The tool must
report exactly those changed elements per class and in total, a delta smaller than the full bytes,
nothing changed between BASE and itself, and refuse (exit 1, naming the tensor) a NEW that lacks a
tensor of BASE (model.norm.weight renamed). Then the INT4 classes: BASE quantized by wsync-int4, one
4-bit code flipped in every 53rd packed word of one tensor and one bit of every 31st scale of
another: the tool must count exactly those words, codes and scales. Pure Python (struct, json), no numpy.
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

# INT4 (wsync-int4 quantize, G 64): one 4-bit code flipped in every 53rd packed word of one
# weight_packed tensor, the low byte of every 31st scale of one weight_scale tensor.
int4a, int4b = os.path.join(work, "int4a"), os.path.join(work, "int4b")
os.makedirs(int4a)
subprocess.run([f"{bin_dir}/wsync-int4", "quantize", "--in", os.path.join(base, files[0]), "--out",
                os.path.join(int4a, files[0]), "--group-size", "64", "--ignore", "lm_head", "--ignore",
                ".*embed_tokens.*"], check=True, stdout=subprocess.DEVNULL)
shutil.copytree(int4a, int4b)
path = os.path.join(int4b, files[0])
with open(path, "rb") as f:
    raw = bytearray(f.read())
(hlen,) = struct.unpack_from("<Q", raw, 0)
header = json.loads(raw[8:8 + hlen])
packed = sorted(k for k in header if k.endswith(".weight_packed"))
scales = sorted(k for k in header if k.endswith(".weight_scale"))
assert packed and scales and header[packed[0]]["dtype"] == "I32" and header[scales[0]]["dtype"] == "BF16", header
words = codes = scale_changes = 0
lo, hi = header[packed[0]]["data_offsets"]
for i in range(0, (hi - lo) // 4, 53):
    raw[8 + hlen + lo + 4 * i + 1] ^= 0x30  # the word's fourth code (bits 12-15)
    words += 1
    codes += 1
lo, hi = header[scales[1]]["data_offsets"]
for i in range(0, (hi - lo) // 2, 31):
    raw[8 + hlen + lo + 2 * i] ^= 0x01
    scale_changes += 1
with open(path, "wb") as f:
    f.write(raw)
rc, out, err = stats(int4a, int4b)
assert rc == 0, err
classes = json.loads(out)["classes"]
w, sc = classes["int4 words"], classes["int4 scales"]
assert (w["changed_items"], w["changed_codes"]) == (words, codes), (w, words, codes)
assert w["codes"] == 8 * w["items"], w
assert sc["changed_items"] == scale_changes, (sc, scale_changes)
assert classes["bf16"]["changed_items"] == 0 and classes["other"]["changed_items"] == 0, classes
shutil.rmtree(work)
print(f"inspect delta: ok ({changed} bf16 elements, {codes} INT4 codes in {words} words, {scale_changes} scales changed,"
      " all found)")
