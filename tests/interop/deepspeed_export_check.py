#!/usr/bin/python3
# Checks `zinf-ckpt export --format deepspeed` output against the same checkpoint's
# `zinf-ckpt export --format safetensors --moments` (the reference), with torch.
#
#   deepspeed_export_check.py structure REF EXPECT DIR:W:STAGE[:universal] ...
#       torch.load reads every file (DeepSpeed's two classes replaced by inert stand-ins); the
#       keys, types and values are those of interop/deepspeed_export.h; the fp32 weights
#       reassembled by zero_to_fp32's rule (each group's W partitions concatenated, walked in
#       param_shapes order) and the moments (the rigid partitions, padding zeros) equal the
#       reference bitwise. ":universal" (--format deepspeed-universal): zero/<name>/{fp32,
#       exp_avg,exp_avg_sq}.pt each {'cat_dim': 0, 'param'} bitwise the reference, step.pt,
#       zero/optimizer_state.pt's keys and values. Both: the model file's top-level keys are the
#       export's own, then the user's (sorted), with EXPECT's values and Python types.
#   deepspeed_export_check.py tools TREE REF EXPECT DIR WORK [UNIVERSAL]
#       DeepSpeed's own zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint and
#       convert_zero_checkpoint_to_fp32_state_dict) and ds_to_universal, run from the DeepSpeed
#       source tree TREE (through bench/harness/deepspeed_shim.py), on DIR: their weights, and
#       the universal files' fp32 / exp_avg / exp_avg_sq / step, equal the reference bitwise. UNIVERSAL (zinf's
#       --format deepspeed-universal export of the same checkpoint, W and stage as DIR): the same
#       files as ds_to_universal's output folder, each loading to the same value (torch.equal on
#       every tensor, the same keys in the same order, types and values), and the same
#       latest_universal.
# EXPECT is JSON: {"step", "skipped", "groups": [[names in layout order], ...] or null (one group
# of every parameter), "dynamic": bool, "adam_w_mode": bool, "user_keys": [the trainer state's
# user keys], "user": {key: value} for those whose values are known}. Exit 0 when all holds, 1
# with the first difference.
import json
import os
import runpy
import sys

import torch

import fake_deepspeed  # this folder is on sys.path: the script is run by path
import safetensors_file


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def check(cond, message):
    if not cond:
        fail(message)


def load_safetensors(path):
    """(the weights' names in order, {name: float32 tensor of its shape}) of zinf's safetensors
    export with --moments (the moments are named exp_avg/<name>, exp_avg_sq/<name>)."""
    tensors = {}
    for name, (_, shape, data) in safetensors_file.read(path)[1].items():
        tensors[name] = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
    return [n for n in tensors if "/" not in n], tensors


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.int32)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# The model file's own top-level keys, in the export's order (interop/deepspeed_export.h).
MODEL_KEYS = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
              "frozen_param_fragments", "shared_params", "lr_scheduler", "data_sampler",
              "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
              "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
              "universal_checkpoint_info"]


def same_value(a, b, ordered=True):
    """Equal values of the same Python types (an int is not a float), tensors bitwise; dict keys
    in the same order unless not `ordered` (a JSON object's keys have none)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and
                a.shape == b.shape and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, ordered) for x, y in zip(a, b))
    if isinstance(a, dict):
        keys_match = list(a.keys()) == list(b.keys()) if ordered else a.keys() == b.keys()
        return keys_match and all(same_value(a[k], b[k], ordered) for k in a)
    if type(a).__module__.startswith("deepspeed."):
        return same_value(vars(a), vars(b))
    return a == b


def check_user(model, expect, where):
    user_keys = sorted(expect["user_keys"])
    check(list(model.keys()) == MODEL_KEYS + user_keys,
          f"{where}: model file keys {list(model.keys())}, expected {MODEL_KEYS} + {user_keys}")
    for key, value in expect["user"].items():
        check(same_value(model[key], value, ordered=False),
              f"{where}: user key {key} is {model[key]!r}, expected {value!r}")


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
    check_user(model, expect, where)
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


def check_universal(ref_path, expect, out_dir, world, stage):
    names, ref = load_safetensors(ref_path)
    where = f"{out_dir} (universal, W={world}, stage {stage})"
    step, skipped = expect["step"], expect["skipped"]
    tag = f"global_step{step}"
    with open(os.path.join(out_dir, "latest_universal"), "rb") as f:
        check(f.read() == tag.encode(), f"{where}: latest_universal")
    check(sorted(os.listdir(out_dir)) == sorted(["latest_universal", tag]),
          f"{where}: {os.listdir(out_dir)}")
    tag_dir = os.path.join(out_dir, tag)
    check(sorted(os.listdir(tag_dir)) == ["mp_rank_00_model_states.pt", "zero"],
          f"{where}: {os.listdir(tag_dir)}")
    zero = os.path.join(tag_dir, "zero")
    check(sorted(os.listdir(zero)) == sorted(names + ["optimizer_state.pt"]),
          f"{where}: zero/ holds {sorted(os.listdir(zero))}")
    for name in names:
        d = os.path.join(zero, name)
        check(sorted(os.listdir(d)) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"],
              f"{where}: zero/{name} holds {os.listdir(d)}")
        for key, ref_name in (("fp32", name), ("exp_avg", f"exp_avg/{name}"),
                              ("exp_avg_sq", f"exp_avg_sq/{name}")):
            v = torch.load(os.path.join(d, f"{key}.pt"))
            check(type(v) is dict and list(v.keys()) == ["cat_dim", "param"] and
                  type(v["cat_dim"]) is int and v["cat_dim"] == 0,
                  f"{where}: zero/{name}/{key}.pt is {v!r}")
            check(same(v["param"], ref[ref_name]), f"{where}: zero/{name}/{key}.pt differs")
        s = torch.load(os.path.join(d, "step.pt"))
        check(type(s) is int and s == step - skipped, f"{where}: zero/{name}/step.pt is {s!r}")
    opt = torch.load(os.path.join(zero, "optimizer_state.pt"))
    keys = ["loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "zero_stage",
            "group_paddings", "partition_count", "ds_version", "param_groups"]
    check(list(opt.keys()) == keys, f"{where}: optimizer_state.pt keys {list(opt.keys())}")
    groups = groups_of(expect, names)
    check(type(opt["zero_stage"]) is int and opt["zero_stage"] == stage, f"{where}: zero_stage")
    check(opt["group_paddings"] == [0] * len(groups) and
          opt["partition_count"] == [world] * len(groups) and opt["ds_version"] == "0.19.6" and
          opt["overflow"] is False and opt["dynamic_loss_scale"] is expect["dynamic"],
          f"{where}: optimizer_state.pt {opt}")
    check(type(opt["loss_scaler"]).__name__ ==
          ("DynamicLossScaler" if expect["dynamic"] else "LossScaler"), f"{where}: loss_scaler")
    check(len(opt["param_groups"]) == len(groups), f"{where}: param_groups")
    for g, pg in enumerate(opt["param_groups"]):
        check(pg["params"] == [g] and type(pg["betas"]) is tuple and
              pg["adam_w_mode"] is expect["adam_w_mode"], f"{where}: param_groups[{g}] {pg}")
    model = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    check(model["dp_world_size"] == world and model["global_steps"] == step,
          f"{where}: model file counters")
    for name in names:
        check(same(model["module"][name], ref[name]), f"{where}: module[{name}] differs")
    check([list(d.keys()) for d in model["param_shapes"]] == groups, f"{where}: param_shapes")
    check_user(model, expect, where)


def compare_universal(theirs, ours):
    """ds_to_universal's output folder `theirs` against zinf's universal export `ours` (its tag
    folder): the same files, each loading to the same value."""
    def files(root):
        return sorted(os.path.relpath(os.path.join(d, f), root)
                      for d, _, fs in os.walk(root) for f in fs)

    check(files(theirs) == files(ours),
          f"universal: ds_to_universal wrote {files(theirs)}, zinf {files(ours)}")
    for rel in files(theirs):
        a = torch.load(os.path.join(theirs, rel))
        b = torch.load(os.path.join(ours, rel))
        check(same_value(a, b), f"universal: {rel} differs: ds_to_universal {a!r}, zinf {b!r}")
    for folder in (theirs, ours):
        with open(os.path.join(os.path.dirname(folder), "latest_universal"), "rb") as f:
            check(f.read() == os.path.basename(ours).encode(), f"{folder}: latest_universal")
    print(f"universal: {len(files(ours))} files equal to ds_to_universal's output")


def check_tools(tree, ref_path, expect, out_dir, work, universal_dir=None):
    # The shim bench/run.py deepspeed-compat runs DeepSpeed's tools with (one copy, the harness's).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "bench", "harness"))
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
    if universal_dir:
        compare_universal(universal, os.path.join(universal_dir, tag))


def main():
    if len(sys.argv) < 2:
        fail("usage: see the top of the file")
    mode = sys.argv[1]
    if mode == "structure" and len(sys.argv) >= 5:
        fake_deepspeed.register()  # torch.load builds DeepSpeed's objects from them
        expect = json.loads(sys.argv[3])
        for spec in sys.argv[4:]:
            universal = spec.endswith(":universal")
            out_dir, world, stage = spec.removesuffix(":universal").rsplit(":", 2)
            if universal:
                check_universal(sys.argv[2], expect, out_dir, int(world), int(stage))
            else:
                check_structure(sys.argv[2], expect, out_dir, int(world), int(stage))
            print(f"ok {out_dir}: W={world} stage {stage}{' universal' if universal else ''}")
    elif mode == "tools" and len(sys.argv) in (7, 8):
        check_tools(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5], sys.argv[6],
                    sys.argv[7] if len(sys.argv) == 8 else None)
    else:
        fail(f"bad arguments {sys.argv[1:]}")


if __name__ == "__main__":
    main()
