"""The safetensors files `zinf-ckpt export --format safetensors [--moments]` writes, read for the
interop tests (checkpoint/checkpoint.h, ExportCheckpoint: an 8-byte little-endian header size,
the JSON header, then the tensors' raw bytes)."""

import collections
import json
import struct


def read(path):
    """(metadata, {name: (dtype, shape, bytes)} in the header's order) of the file at `path`."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size], object_pairs_hook=collections.OrderedDict)
    base = 8 + size
    tensors = collections.OrderedDict()
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        tensors[name] = (spec["dtype"], spec["shape"], data[base + begin:base + end])
    return header.get("__metadata__", {}), tensors
