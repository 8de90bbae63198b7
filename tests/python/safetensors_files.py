"""safetensors files with the standard library only (the format: u64 header size, JSON header, data),
for the tests and their training processes, which run in environments without pytest."""

import json
import pathlib


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file (its format: u64 header size, JSON, data)."""
    raw = pathlib.Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def write_safetensors(path, tensors):
    """Writes {name: (dtype, shape, bytes)} as a safetensors file (header padded to 8 bytes)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, (_, _, data) in tensors.items():
            f.write(data)
