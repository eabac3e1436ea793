#!/usr/bin/python3
"""Checks for deepspeed_import_test.sh (no torch needed): two zinf checkpoints compared through
`zinf-ckpt export --format safetensors --moments` (every tensor's bytes, the header but its
`source`) and `zinf-ckpt ls` (the trainer state and the optimizer).

  deepspeed_import_check.py roundtrip ZINF_CKPT ORIGINAL IMPORTED W
      weights and both moments bitwise; the imported trainer state holds the original's step,
      skipped steps, scheduler position, loss scaler, parameter groups and user state, with
      world_size W (the DeepSpeed export's); the same optimizer (type resolved to Adam/AdamW).
  deepspeed_import_check.py same ZINF_CKPT A B
      weights, moments and the whole trainer state equal (two resumed runs' checkpoints).
Exit 0 when they hold, 1 with the first difference otherwise.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile


def run(ckpt, *args):
    r = subprocess.run([ckpt, *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAIL: zinf-ckpt {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r.stdout


def tensors(ckpt, path, tmp):
    out = os.path.join(tmp, os.path.basename(path) + f".{len(os.listdir(tmp))}.safetensors")
    run(ckpt, "export", path, "--format", "safetensors", "--moments", "--out", out)
    with open(out, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"].pop("source")
    return header, data[8 + n:]


def meta(ckpt, path):
    found = {}
    for line in run(ckpt, "ls", path).splitlines():
        for key in ("trainer", "optimizer"):
            if line.startswith(f"  {key} "):
                found[key] = json.loads(line[len(key) + 3:])
    return found


def adamw(optimizer):
    t = optimizer["type"].lower()
    return t == "adamw" or optimizer.get("params", {}).get("adam_w_mode", True)


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def main():
    mode, ckpt, a, b = sys.argv[1:5]
    with tempfile.TemporaryDirectory(prefix="zinf-dsimport-check-") as tmp:
        (ha, da), (hb, db) = tensors(ckpt, a, tmp), tensors(ckpt, b, tmp)
    if ha != hb:
        fail(f"safetensors headers differ:\n{ha}\n{hb}")
    if da != db:
        at = next(i for i in range(min(len(da), len(db))) if da[i] != db[i])
        name = next(k for k, v in ha.items() if k != "__metadata__" and
                    v["data_offsets"][0] <= at < v["data_offsets"][1])
        fail(f"tensor {name} differs (byte {at} of the data)")
    ma, mb = meta(ckpt, a), meta(ckpt, b)
    ta, tb = ma["trainer"], mb["trainer"]
    if mode == "same":
        if ta != tb:
            fail(f"trainer states differ:\n{ta}\n{tb}")
        print(f"ok: {len(ha) - 1} tensors and the trainer state equal")
        return 0
    world = int(sys.argv[5])
    if tb["world_size"] != world:
        fail(f"imported world_size {tb['world_size']}, expected {world}")
    for key in ("step", "skipped_steps", "scheduler_last_batch_iteration", "user"):
        if ta.get(key) != tb.get(key):
            fail(f"trainer {key}: original {ta.get(key)}, imported {tb.get(key)}")
    # A group's parameters are a set (engine/trainer_state.h): the import lists them in layout
    # order.
    groups = [[dict(g, params=sorted(g["params"])) for g in t["param_groups"]] for t in (ta, tb)]
    if groups[0] != groups[1]:
        fail(f"trainer param_groups: original {groups[0]}, imported {groups[1]}")
    # A dynamic scaler's state travels; a static or disabled one's is not kept (a resume ignores
    # it).
    scaler = ta.get("loss_scaler")
    if (scaler if scaler and scaler.get("dynamic") else None) != tb.get("loss_scaler"):
        fail(f"trainer loss_scaler: original {scaler}, imported {tb.get('loss_scaler')}")
    if ma["optimizer"]["type"] != mb["optimizer"]["type"] or adamw(ma["optimizer"]) != adamw(
            mb["optimizer"]):
        fail(f"optimizer: original {ma['optimizer']}, imported {mb['optimizer']}")
    print(f"ok: {len(ha) - 1} tensors bitwise; step {tb['step']}, skipped "
          f"{tb.get('skipped_steps', 0)}, scaler, groups and user state as the original")
    return 0


if __name__ == "__main__":
    sys.exit(main())
