"""Changes a fraction of the bf16 elements of an HF checkpoint in place, as one optimizer step at an
RL learning rate does (most elements keep their bf16 bytes; those that change move by one ulp):
for each bf16 tensor of every *.safetensors file in DIR, FRACTION of its elements (at least one),
drawn with SEED, get their lowest mantissa bit flipped. Standard library only (the e2e scripts run
it with the system python3).

    perturb_hf.py DIR FRACTION SEED
"""
import json
import pathlib
import random
import struct
import sys


def main():
    root, fraction, seed = pathlib.Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    changed = total = 0
    for path in sorted(root.glob("*.safetensors")):
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        for name, t in sorted(header.items()):
            if name == "__metadata__" or t["dtype"] != "BF16":
                continue
            begin, end = (8 + n + o for o in t["data_offsets"])
            items = (end - begin) // 2
            k = max(1, int(items * fraction))
            for i in rng.sample(range(items), k):
                data[begin + 2 * i] ^= 1  # little-endian bf16: the low byte holds the lowest mantissa bits
            changed += k
            total += items
        path.write_bytes(data)
    print(f"perturb_hf: {changed} of {total} bf16 elements changed by one ulp")


if __name__ == "__main__":
    main()
