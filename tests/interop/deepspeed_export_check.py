#!/usr/bin/python3
# Checks `zinf-ckpt export --format deepspeed` output against the same checkpoint's
# `zinf-ckpt export --format safetensors --moments` (the reference), with torch.
#
#   deepspeed_export_check.py structure REF EXPECT DIR:W:STAGE ...
#       torch.load reads every file (DeepSpeed's two classes replaced by inert stand-ins); the
#       keys, types and values are those of interop/deepspeed_export.h; the fp32 weights
#       reassembled by zero_to_fp32's rule (each group's W partitions concatenated, walked in
#       param_shapes order) and the moments (the rigid partitions, padding zeros) equal the
#       reference bitwise.
#   deepspeed_export_check.py tools TREE REF EXPECT DIR WORK
#       DeepSpeed's own zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint and
#       convert_zero_checkpoint_to_fp32_state_dict) and ds_to_universal, run from the DeepSpeed
#       source tree TREE (deepspeed_shim.py), on DIR: their weights, and the universal files'
#       fp32 / exp_avg / exp_avg_sq / step, equal the reference bitwise.
# EXPECT is JSON: {"step", "skipped", "groups": [[names in layout order], ...] or null (one group
# of every parameter), "dynamic": bool, "adam_w_mode": bool}. Exit 0 when all holds, 1 with the
# first difference.
import json
import os
import runpy
import struct
import sys
import types

import torch


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def check(cond, message):
    if not cond:
        fail(message)


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    tensors = {}
    names = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + begin : base + end]), dtype=torch.float32)
        tensors[name] = t.reshape(spec["shape"])
        if "/" not in name:
            names.append(name)
    return names, tensors


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.int32)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def install_stand_ins():
    """Inert classes under DeepSpeed's names, so that torch.load builds the objects."""
    for name in ("deepspeed", "deepspeed.utils", "deepspeed.utils.tensor_fragment",
                 "deepspeed.runtime", "deepspeed.runtime.fp16",
                 "deepspeed.runtime.fp16.loss_scaler"):
        sys.modules[name] = types.ModuleType(name)
    for module, cls in (("deepspeed.utils.tensor_fragment", "fragment_address"),
                        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")):
        c = type(cls, (), {"__module__": module})
        setattr(sys.modules[module], cls, c)


def groups_of(expect, names):
    return expect["groups"] if expect.get("groups") else [list(names)]


def check_structure(ref_path, expect, out_dir, world, stage):
    names, ref = load_safetensors(ref_path)
    where = f"{out_dir} (W={world}, stage {stage})"
    with open(os.path.join(out_dir, "latest"), "rb") as f:
        tag = f.read().decode()
    check(tag == f"global_step{expect['step']}", f"{where}: latest is {tag!r}")
    tag_dir = os.path.join(out_dir, tag)
    files = sorted(os.listdir(tag_dir))
    want = sorted(["mp_rank_00_model_states.pt"] +
                  [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)])
    check(files == want, f"{where}: files {files}")
    check(sorted(os.listdir(out_dir)) == sorted(["latest", tag]), f"{where}: {os.listdir(out_dir)}")

    model = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    step, skipped = expect["step"], expect["skipped"]
    for key, value in (("buffer_names", []), ("shared_params", {}), ("frozen_param_shapes", None),
                       ("frozen_param_fragments", None), ("global_steps", step),
                       ("skipped_steps", skipped), ("dp_world_size", world),
                       ("mp_world_size", 1), ("ds_version", "0.19.6"),
                       ("lr_scheduler", {"last_batch_iteration": step - skipped - 1}),
                       ("checkpoint_parallel_dimensions", {"pp_degree": 1, "tp_degree": 1}),
                       ("universal_checkpoint_info", {"universal_checkpoint_version": 0.4})):
        check(key in model and model[key] == value and type(model[key]) is type(value),
              f"{where}: model file {key} is {model.get(key)!r}, expected {value!r}")
    check(isinstance(model["ds_config"], dict), f"{where}: ds_config is not a dict")
    check(list(model["module"].keys()) == names, f"{where}: module keys {list(model['module'])}")
    for name in names:
        check(same(model["module"][name], ref[name]), f"{where}: module[{name}] differs")
    groups = groups_of(expect, names)
    shapes = model["param_shapes"]
    check(isinstance(shapes, list) and len(shapes) == len(groups),
          f"{where}: param_shapes {shapes}")
    for g, group in enumerate(groups):
        check(list(shapes[g].keys()) == group, f"{where}: param_shapes[{g}] {list(shapes[g])}")
        for name in group:
            check(isinstance(shapes[g][name], torch.Size) and shapes[g][name] == ref[name].shape,
                  f"{where}: param_shapes[{g}][{name}] = {shapes[g][name]!r}")

    optim = [torch.load(os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
             for r in range(world)]
    for r, o in enumerate(optim):
        check(sorted(o.keys()) == ["ds_config", "ds_version", "optimizer_state_dict"],
              f"{where}: rank {r} top-level keys {sorted(o)}")
        sd = o["optimizer_state_dict"]
        check(type(sd["zero_stage"]) is int and sd["zero_stage"] == stage,
              f"{where}: rank {r} zero_stage {sd['zero_stage']!r}")
        check(sd["partition_count"] == [world] * len(groups), f"{where}: partition_count")
        check(sd["ds_version"] == "0.19.6" and sd["overflow"] is False, f"{where}: ds_version")
        scaler = sd["loss_scaler"]
        want_scaler = "DynamicLossScaler" if expect["dynamic"] else "LossScaler"
        check(type(scaler).__name__ == want_scaler and
              sd["dynamic_loss_scale"] == expect["dynamic"],
              f"{where}: loss scaler {type(scaler).__name__} {vars(scaler)}")
        check(vars(scaler)["dynamic"] is expect["dynamic"], f"{where}: scaler dynamic")
        base = sd["base_optimizer_state"]
        check(sorted(base["state"].keys()) == list(range(len(groups))), f"{where}: state keys")
        for g, pg in enumerate(base["param_groups"]):
            check(pg["params"] == [g] and type(pg["betas"]) is tuple and
                  pg["bias_correction"] is True and pg["adam_w_mode"] is expect["adam_w_mode"],
                  f"{where}: param_groups[{g}] {pg}")
            check(type(base["state"][g]["step"]) is int and
                  base["state"][g]["step"] == step - skipped, f"{where}: step")

    for g, group in enumerate(groups):
        n = sum(ref[name].numel() for name in group)
        part = 2 * -(-n // (2 * world))
        # zero_to_fp32's rule: the ranks' fp32 partitions concatenated, walked in shape order.
        parts = [o["optimizer_state_dict"]["single_partition_of_fp32_groups"][g] for o in optim]
        for r, p in enumerate(parts):
            keep = min(max(n - r * part, 0), part)
            check(p.dtype == torch.float32 and p.numel() == keep,
                  f"{where}: group {g} rank {r} fp32 has {p.numel()} elements, expected {keep}")
            pad = optim[r]["optimizer_state_dict"]["group_paddings"][g]
            check(pad == part - keep, f"{where}: group {g} rank {r} padding {pad}")
        flat = torch.cat(parts)
        check(flat.numel() == n, f"{where}: group {g} fp32 holds {flat.numel()}, expected {n}")
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = [o["optimizer_state_dict"]["base_optimizer_state"]["state"][g][key]
                      for o in optim]
            check(all(p.numel() == part for p in pieces), f"{where}: group {g} {key} lengths")
            full = torch.cat(pieces)
            check(torch.count_nonzero(full[n:]) == 0, f"{where}: group {g} {key} padding not 0")
            moments[key] = full[:n]
        offset = 0
        for name in group:
            numel = ref[name].numel()
            check(same(flat.narrow(0, offset, numel).view(ref[name].shape), ref[name]),
                  f"{where}: weights of {name} differ")
            for key, full in moments.items():
                check(same(full.narrow(0, offset, numel).view(ref[name].shape),
                           ref[f"{key}/{name}"]), f"{where}: {key} of {name} differs")
            # The fragment of each rank overlapping the parameter, start relative to the rank.
            for r, o in enumerate(optim):
                lo, hi = r * part, min((r + 1) * part, n)
                begin, end = max(offset, lo), min(offset + numel, hi)
                mapping = o["optimizer_state_dict"]["param_slice_mappings"][g]
                if begin < end:
                    a = vars(mapping.get(name, object()))
                    check(a == {"numel": end - begin, "start": begin - lo},
                          f"{where}: rank {r} mapping of {name} is {a}")
                else:
                    check(name not in mapping, f"{where}: rank {r} maps {name}, not its own")
            offset += numel
        for r, o in enumerate(optim):
            order = list(o["optimizer_state_dict"]["param_slice_mappings"][g].keys())
            check(order == [x for x in group if x in order], f"{where}: mapping order {order}")


def check_tools(tree, ref_path, expect, out_dir, work):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import deepspeed_shim

    deepspeed_shim.install(tree)
    from deepspeed.utils import zero_to_fp32

    names, ref = load_safetensors(ref_path)
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(out_dir)
    check(sorted(state.keys()) == sorted(names), f"zero_to_fp32 names {sorted(state)}")
    for name in names:
        check(same(state[name].float(), ref[name]), f"zero_to_fp32: {name} differs from zinf's")
    converted = os.path.join(work, "fp32")
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(out_dir, converted, max_shard_size=None)
    saved = torch.load(os.path.join(converted, "pytorch_model.bin"))
    for name in names:
        check(same(saved[name], ref[name]), f"convert_zero_checkpoint_to_fp32_state_dict: {name}")
    print(f"zero_to_fp32: {len(names)} parameters bitwise equal to zinf's fp32 weights")

    tag = open(os.path.join(out_dir, "latest")).read().strip()
    universal = os.path.join(work, "universal", tag)
    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", os.path.join(out_dir, tag), "--output_folder",
                universal, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__",
                         alter_sys=True)
    finally:
        sys.argv = argv
    for name in names:
        for key, ref_name in (("fp32", name), ("exp_avg", f"exp_avg/{name}"),
                              ("exp_avg_sq", f"exp_avg_sq/{name}")):
            d = torch.load(os.path.join(universal, "zero", name, f"{key}.pt"))
            check(same(d["param"], ref[ref_name]), f"ds_to_universal: {name}/{key}.pt differs")
        s = torch.load(os.path.join(universal, "zero", name, "step.pt"))
        check(int(s) == expect["step"] - expect["skipped"], f"ds_to_universal: step.pt is {s}")
    print(f"ds_to_universal: fp32, exp_avg, exp_avg_sq of {len(names)} parameters bitwise equal")


def main():
    if len(sys.argv) < 2:
        fail("usage: see the top of the file")
    mode = sys.argv[1]
    if mode == "structure" and len(sys.argv) >= 5:
        install_stand_ins()
        expect = json.loads(sys.argv[3])
        for spec in sys.argv[4:]:
            out_dir, world, stage = spec.rsplit(":", 2)
            check_structure(sys.argv[2], expect, out_dir, int(world), int(stage))
            print(f"ok {out_dir}: W={world} stage {stage}")
    elif mode == "tools" and len(sys.argv) == 7:
        check_tools(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        fail(f"bad arguments {sys.argv[1:]}")


if __name__ == "__main__":
    main()
