#!/usr/bin/python3
"""DeepSpeed checkpoints read by zinf (interop/deepspeed.h), through deepspeed_read_tool.

Run by CTest: /usr/bin/python3 deepspeed_read_test.py DEEPSPEED_READ_TOOL. Exit 77 (skipped) when
torch cannot be imported.

The directories are written here from DeepSpeed's documented layout (issue 46's spec, sections 1
and 2; no DeepSpeed code), with fake `deepspeed.*` modules registered in sys.modules
(fake_deepspeed.py) so that fragment_address, LossScaler, DynamicLossScaler and ZeroStageEnum
pickle under DeepSpeed's names:
  - ZeRO 1/2, W = 1..4: two param groups, padding at the end of each flat group, a rank entirely
    in padding, params split across ranks, fp32 partitions saved as views of the padded
    partition, garbage (NaN) in the moments' padding; fp16 DynamicLossScaler with skipped steps;
    elastic files; BF16_Optimizer files (no zero_stage, padded fp32, bf16_ prefix);
  - ZeRO 3, W = 1..4: two sub-groups, per-param pieces of ceil(numel/W);
  - universal folders (what DeepSpeed's ds_to_universal writes; spec sections 1.5 and 3): from
    stage 1/2 (W = 1..3, two groups, {'param', 'cat_dim'} dicts and step.pt) and from stage 3
    (bare flat tensors, the step in zero/optimizer_state.pt), read directly and through
    `latest_universal`;
  and `deepspeed_read_tool dump` must give every param's fp32, exp_avg and exp_avg_sq bitwise, in
  the model file's module order, with the steps, scaler, config, groups and client state;
  - hostile directories: each exits 1 with a message naming the defect.
"""

import collections
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest
import zipfile

try:
    import torch
except Exception as e:  # noqa: BLE001 - any import failure means: no torch here
    print(f"SKIP: {sys.executable} cannot import torch ({e!r}); install python3-torch")
    sys.exit(77)

import fake_deepspeed  # noqa: E402 - after the torch check: it imports torch
from fake_deepspeed import (  # noqa: E402 - deepspeed_import_test.py uses them too
    DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address)

fake_deepspeed.register()

TOOL = None  # set from argv in main


class RunsCode:
    """A pickle that would call os.system if unpickled by Python."""

    def __reduce__(self):
        return (os.system, ("echo zinf-was-here > /dev/null",))


def bits(t):
    flat = t.detach().contiguous().reshape(-1).float()
    return [f"{v & 0xFFFFFFFF:08x}" for v in flat.view(torch.int32).tolist()]


# Two param groups; module order differs from param_shapes order (group-major).
GROUPS = [collections.OrderedDict([("a.weight", (3, 5)), ("a.bias", (5,)), ("b.weight", (7,))]),
          collections.OrderedDict([("c.weight", (2, 2)), ("c.bias", (1,))])]
MODULE_ORDER = ["c.bias", "a.weight", "bn.running_mean", "c.weight", "a.bias", "b.weight",
                "lm_head.weight"]
CONFIG = {"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 0, "hysteresis": 2},
          "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW",
                                                          "params": {"lr": 0.001}}}


def make_values(groups, seed):
    g = torch.Generator().manual_seed(seed)
    vals = {}
    for grp in groups:
        for name, shape in grp.items():
            vals[name] = (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g),
                          torch.rand(*shape, generator=g))
    return vals


def model_states(groups, vals, global_steps, skipped, scheduler=True, **extra):
    module = collections.OrderedDict()
    for name in MODULE_ORDER:
        if name in vals:
            module[name] = vals[name][0].half()
        elif name == "bn.running_mean":
            module[name] = torch.zeros(3)
        elif name == "lm_head.weight":
            module[name] = vals["a.weight"][0].half()
    ms = {
        "module": module, "buffer_names": ["bn.running_mean"], "optimizer": None,
        "param_shapes": [collections.OrderedDict((n, torch.Size(s)) for n, s in g.items())
                         for g in groups],
        "frozen_param_shapes": None, "frozen_param_fragments": None,
        "shared_params": {"lm_head.weight": "a.weight"},
        "lr_scheduler": ({"last_batch_iteration": global_steps - skipped - 1} if scheduler
                         else None),
        "sparse_tensor_module_names": set(),
        "skipped_steps": skipped, "global_steps": global_steps, "global_samples": global_steps * 8,
        "dp_world_size": 1, "mp_world_size": 1, "ds_config": CONFIG, "ds_version": "0.19.6",
    }
    ms.update(extra)
    return ms


def adam_group(lr, params):
    return {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False, "params": params}


def write_stage12(out, world, stage=2, seed=0, global_steps=7, skipped=0, scaler=None,
                  elastic=False, bf16=False, step_kind="tensor", groups=GROUPS):
    """A save dir in DeepSpeed's ZeRO 1/2 layout; returns {name: (fp32, exp_avg, exp_avg_sq)}."""
    vals = make_values(groups, seed)
    step = global_steps - skipped
    tag = f"global_step{global_steps}"
    d = os.path.join(out, tag)
    os.makedirs(d)
    flats = []
    for grp in groups:
        flats.append([torch.cat([vals[n][k].reshape(-1) for n in grp]) for k in range(3)])
    for r in range(world):
        fp32, moments, paddings, maps, state = [], [], [], [], {}
        for gi, (grp, flat) in enumerate(zip(groups, flats)):
            n = flat[0].numel()
            P = 2 * math.ceil(n / (2 * world))
            lo, hi = r * P, (r + 1) * P
            valid = max(0, min(P, n - lo))
            # The padded partition: garbage in the padding, which a reader must never return.
            part = [torch.full((P,), float("nan")) for _ in range(3)]
            part[0][:] = 7.0
            for k in range(3):
                part[k][:valid] = flat[k][lo:lo + valid]
            fp32.append(part[0] if bf16 else part[0][:valid])  # a view of the whole partition
            if elastic:
                # Views at a storage offset (3 NaNs before them), as a view of a larger buffer.
                ea, es = (torch.cat([torch.full((3,), float("nan")), part[k][:valid]])[3:]
                          for k in (1, 2))
            else:
                ea, es = part[1], part[2]
            if step_kind == "int":
                st = step
            elif step_kind == "int64":
                st = torch.tensor(step, dtype=torch.int64)
            else:
                st = torch.tensor(float(step))
            state[gi] = {"step": st, "exp_avg": ea, "exp_avg_sq": es}
            paddings.append((P * world - n if r == world - 1 else 0) if bf16 else P - valid)
            mp, off = collections.OrderedDict(), 0
            for name, shape in grp.items():
                k = math.prod(shape)
                s, e = max(off, lo), min(off + k, lo + valid)
                if s < e:
                    mp[name] = fragment_address(numel=e - s, start=s - lo)
                off += k
            maps.append(mp)
        if elastic:
            base = [state[gi] for gi in range(len(groups))]
        else:
            base = {"state": state,
                    "param_groups": [adam_group(1e-3 * (gi + 1), [gi])
                                     for gi in range(len(groups))]}
        osd = {"base_optimizer_state": base, "single_partition_of_fp32_groups": fp32,
               "group_paddings": paddings, "partition_count": [world] * len(groups),
               "ds_version": "0.19.6", "param_slice_mappings": maps, "clip_grad": 1.0}
        if not bf16:
            osd.update({"loss_scaler": scaler if scaler is not None else LossScaler(1.0),
                        "dynamic_loss_scale": isinstance(scaler, DynamicLossScaler),
                        "overflow": False,
                        "zero_stage": (ZeroStageEnum.gradients if stage == 2
                                       else ZeroStageEnum.optimizer_states)})
        prefix = "bf16_" if bf16 else ""
        torch.save({"optimizer_state_dict": osd, "ds_config": CONFIG, "ds_version": "0.19.6"},
                   os.path.join(d, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    torch.save(model_states(groups, vals, global_steps, skipped),
               os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(d, "zero_to_fp32.py"), "w") as f:
        f.write("# DeepSpeed's script lives here; the reader ignores it\n")
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)
    return vals


SUBGROUPS = [collections.OrderedDict([("a.weight", (3, 5)), ("a.bias", (5,))]),
             collections.OrderedDict([("b.weight", (7,)), ("c.weight", (2, 2)),
                                      ("c.bias", (1,))])]


def write_stage3(out, world, seed=3, global_steps=5, skipped=0):
    vals = make_values(SUBGROUPS, seed)
    step = global_steps - skipped
    tag = f"global_step{global_steps}"
    d = os.path.join(out, tag)
    os.makedirs(d)

    def piece(t, r):
        n = t.numel()
        pn = math.ceil(n / world)
        f = torch.cat([t.reshape(-1), torch.full((pn * world - n,), float("nan"))])
        return f[r * pn:(r + 1) * pn]

    for r in range(world):
        flat = [[torch.cat([piece(vals[n][k], r) for n in g]) for g in SUBGROUPS]
                for k in range(3)]
        inner = {"state": {s: {"step": step, "exp_avg": flat[1][s], "exp_avg_sq": flat[2][s]}
                           for s in range(len(SUBGROUPS))},
                 "param_groups": [adam_group(2e-3, list(range(len(SUBGROUPS))))]}
        osd = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
               "dynamic_loss_scale": False, "overflow": False, "partition_count": world,
               "optimizer_state_dict": inner, "fp32_flat_groups": flat[0]}
        torch.save({"optimizer_state_dict": osd, "ds_config": CONFIG, "ds_version": "0.19.6"},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        ms = model_states(SUBGROUPS, vals, global_steps, skipped)
        # A stage 3 module holds placeholders: empty tensors of the run's dtype.
        ms["module"] = collections.OrderedDict(
            (k, torch.empty(0, dtype=torch.float16) if k in vals else v)
            for k, v in ms["module"].items())
        torch.save(ms, os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag + "\n")
    return vals


def param_values(k, v):
    return {"fp32": v[0], "exp_avg": v[1], "exp_avg_sq": v[2]}


def write_universal12(out, world, stage=2, seed=40, global_steps=7, skipped=0, scaler=None,
                      step_kind="int", groups=GROUPS, folder="global_step7_universal", **extra):
    """A universal folder as ds_to_universal writes it from a ZeRO 1/2 checkpoint of `world`
    ranks, under `out` (with out/latest_universal naming it); returns the values."""
    vals = make_values(groups, seed)
    step = global_steps - skipped
    uc = os.path.join(out, folder)
    zero = os.path.join(uc, "zero")
    os.makedirs(zero)
    torch.save(model_states(groups, vals, global_steps, skipped, **extra),
               os.path.join(uc, "mp_rank_00_model_states.pt"))
    torch.save({"loss_scaler": scaler if scaler is not None else LossScaler(1.0),
                "dynamic_loss_scale": isinstance(scaler, DynamicLossScaler), "overflow": False,
                "clip_grad": 1.0,
                "zero_stage": (ZeroStageEnum.gradients if stage == 2
                               else ZeroStageEnum.optimizer_states),
                "group_paddings": [0] * len(groups), "partition_count": [world] * len(groups),
                "ds_version": "0.19.6",
                "param_groups": [adam_group(1e-3 * (gi + 1), [gi]) for gi in range(len(groups))]},
               os.path.join(zero, "optimizer_state.pt"))
    for grp in groups:
        for name in grp:
            d = os.path.join(zero, name)
            os.makedirs(d)
            for field, t in param_values(name, vals[name]).items():
                torch.save({"param": t.clone(), "cat_dim": 0}, os.path.join(d, f"{field}.pt"))
            if step_kind == "int":
                st = step
            elif step_kind == "int64":
                st = torch.tensor(step, dtype=torch.int64)
            else:
                st = torch.tensor(float(step))
            torch.save(st, os.path.join(d, "step.pt"))
    with open(os.path.join(out, "latest_universal"), "w") as f:
        f.write(folder)
    return vals


def write_universal3(out, world, seed=50, global_steps=5, skipped=0,
                     folder="global_step5_universal"):
    """A universal folder as ds_to_universal writes it from a ZeRO 3 checkpoint."""
    vals = make_values(SUBGROUPS, seed)
    step = global_steps - skipped
    uc = os.path.join(out, folder)
    zero = os.path.join(uc, "zero")
    os.makedirs(zero)
    for r in range(world):
        ms = model_states(SUBGROUPS, vals, global_steps, skipped)
        ms["module"] = collections.OrderedDict(
            (k, torch.empty(0, dtype=torch.float16) if k in vals else v)
            for k, v in ms["module"].items())
        torch.save(ms, os.path.join(uc, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    groups = [adam_group(2e-3, list(range(len(SUBGROUPS))))]
    # Rank 0's optimizer state as the source held it (its partitions too, which are not read).
    inner = {"state": {s: {"step": step, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
                       for s in range(len(SUBGROUPS))},
             "param_groups": groups}
    torch.save({"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                "dynamic_loss_scale": False, "overflow": False, "partition_count": world,
                "optimizer_state_dict": inner,
                "fp32_flat_groups": [torch.zeros(3) for _ in SUBGROUPS], "param_groups": groups},
               os.path.join(zero, "optimizer_state.pt"))
    for g in SUBGROUPS:
        for name in g:
            d = os.path.join(zero, name)
            os.makedirs(d)
            for field, t in param_values(name, vals[name]).items():
                torch.save(t.reshape(-1).clone(), os.path.join(d, f"{field}.pt"))
    with open(os.path.join(out, "latest_universal"), "w") as f:
        f.write(folder + "\n")
    return vals


def flip_storage_byte(path):
    """Flips a bit in the first storage of the torch file `path` bigger than 8 bytes."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 8)
    with open(path, "r+b") as f:
        # The local header: 30 bytes, then name and extra (the reader's layout of torch's
        # files: stored, 64-byte aligned through the extra field).
        f.seek(info.header_offset + 26)
        n, e = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + n + e + 4
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


CLIENT = {"my_dict": {"a": [1, 2.5, "x"], "b": None}, "my_list": [1, (2, 3)], "my_int": 3,
          "my_str": "hello"}


def run_tool(path):
    return subprocess.run([TOOL, "dump", path], capture_output=True, text=True, timeout=60)


class DeepSpeedRead(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="zinf_ds_read_")
        self.n = 0

    def tearDown(self):
        self.tmp.cleanup()

    def new_dir(self):
        self.n += 1
        return os.path.join(self.tmp.name, f"ckpt{self.n}")

    def dump(self, path):
        r = run_tool(path)
        self.assertEqual(r.returncode, 0, f"dump {path}: {r.stderr}")
        return json.loads(r.stdout)

    def check_values(self, js, vals, order):
        self.assertEqual([p["name"] for p in js["params"]], order)
        for p in js["params"]:
            fp32, ea, es = vals[p["name"]]
            self.assertEqual(p["shape"], list(fp32.shape), p["name"])
            self.assertEqual(p["numel"], fp32.numel())
            self.assertEqual(p["dtype"], "float16")
            self.assertEqual(p["fp32"], bits(fp32), p["name"])
            self.assertEqual(p["exp_avg"], bits(ea), p["name"])
            self.assertEqual(p["exp_avg_sq"], bits(es), p["name"])

    def test_stage1_and_2_every_world_size(self):
        order = [n for n in MODULE_ORDER if n in make_values(GROUPS, 0)]
        for stage in (1, 2):
            for world in (1, 2, 3, 4):
                for step_kind in ("tensor", "int", "int64"):
                    if step_kind != "tensor" and (stage, world) != (2, 3):
                        continue
                    with self.subTest(stage=stage, world=world, step=step_kind):
                        out = self.new_dir()
                        vals = write_stage12(out, world, stage=stage, seed=world,
                                             step_kind=step_kind)
                        js = self.dump(out)
                        self.assertEqual(js["stage"], stage)
                        self.assertEqual(js["world_size"], world)
                        self.assertFalse(js["bf16_optimizer"])
                        self.assertEqual(js["global_steps"], 7)
                        self.assertEqual(js["skipped_steps"], 0)
                        self.assertEqual(js["scheduler_last_batch_iteration"], 6)
                        self.assertEqual(js["loss_scaler"]["kind"], "static")
                        self.assertEqual(js["ds_config"], CONFIG)
                        self.assertEqual(js["shared_params"], [["lm_head.weight", "a.weight"]])
                        self.assertFalse(js["universal"])
                        self.assertEqual(js["client_state"], {})
                        self.assertEqual(js["client_state_skipped"], [])
                        groups = js["optimizer_groups"]
                        self.assertEqual(len(groups), 2)
                        self.assertEqual([g["lr"] for g in groups], [1e-3, 2e-3])
                        self.assertEqual(groups[0]["betas"], [0.9, 0.999])
                        self.assertEqual(groups[0]["eps"], 1e-8)
                        self.assertEqual(groups[0]["weight_decay"], 0.01)
                        self.assertEqual(groups[0]["options"]["amsgrad"], False)
                        self.assertEqual({p["name"]: p["group"] for p in js["params"]},
                                         {"a.weight": 0, "a.bias": 0, "b.weight": 0,
                                          "c.weight": 1, "c.bias": 1})
                        self.check_values(js, vals, order)
                        # The tag directory itself reads the same.
                        self.assertEqual(self.dump(os.path.join(out, "global_step7")), js)

    def test_fp16_dynamic_scaler_skipped_steps(self):
        out = self.new_dir()
        scaler = DynamicLossScaler(2.0 ** 13, 10, 6, 1)
        vals = write_stage12(out, 3, global_steps=10, skipped=2, scaler=scaler, seed=11)
        js = self.dump(out)
        self.assertEqual((js["global_steps"], js["skipped_steps"]), (10, 2))
        self.assertEqual(js["scheduler_last_batch_iteration"], 7)
        s = js["loss_scaler"]
        self.assertEqual((s["kind"], s["scale"], s["iteration"], s["last_overflow_iteration"],
                          s["hysteresis"]), ("dynamic", 8192.0, 10, 6, 1))
        self.assertEqual(s["state"]["dtype"], "float16")
        self.assertEqual(s["state"]["scale_window"], 1000)
        self.check_values(js, vals, [n for n in MODULE_ORDER if n in vals])

    def test_elastic_and_bf16_optimizer(self):
        for kind in ("elastic", "bf16"):
            for world in (1, 3, 4):
                with self.subTest(kind=kind, world=world):
                    out = self.new_dir()
                    vals = write_stage12(out, world, stage=1, seed=20 + world,
                                         elastic=kind == "elastic", bf16=kind == "bf16")
                    js = self.dump(out)
                    self.assertEqual(js["elastic"], kind == "elastic")
                    self.assertEqual(js["bf16_optimizer"], kind == "bf16")
                    self.assertEqual(js["stage"], 1)
                    if kind == "elastic":
                        self.assertFalse(js["optimizer_groups"][0]["saved"])
                    else:
                        self.assertEqual(js["loss_scaler"]["kind"], "none")
                    self.check_values(js, vals, [n for n in MODULE_ORDER if n in vals])

    def test_stage3_every_world_size(self):
        for world in (1, 2, 3, 4):
            with self.subTest(world=world):
                out = self.new_dir()
                vals = write_stage3(out, world, seed=30 + world)
                js = self.dump(out)
                self.assertEqual(js["stage"], 3)
                self.assertEqual(js["world_size"], world)
                self.assertEqual(js["global_steps"], 5)
                self.assertEqual(len(js["optimizer_groups"]), 1)
                self.assertEqual(js["optimizer_groups"][0]["lr"], 2e-3)
                self.assertTrue(all(p["group"] == 0 for p in js["params"]))
                self.check_values(js, vals, [n for n in MODULE_ORDER if n in vals])

    # ---- hostile directories: exit 1, a message naming the defect ----
    def expect_error(self, path, *needles):
        r = run_tool(path)
        self.assertEqual(r.returncode, 1, f"exit {r.returncode}: {r.stdout[:300]} {r.stderr}")
        for needle in needles:
            self.assertIn(needle, r.stderr)
        self.assertEqual(r.stdout, "")

    def stage2(self, world=3, **kw):
        out = self.new_dir()
        write_stage12(out, world, **kw)
        return out, os.path.join(out, "global_step7")

    def optim(self, tag, r):
        return os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")

    def test_truncated_file(self):
        out, tag = self.stage2()
        path = self.optim(tag, 1)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        self.expect_error(out, "zero_pp_rank_1_mp_rank_00_optim_states.pt")

    def test_not_a_dict(self):
        out, tag = self.stage2()
        torch.save([1, 2, 3], self.optim(tag, 0))
        self.expect_error(out, "DataLoss", "zero_pp_rank_0", "a list, not a dict")

    def test_pickle_that_runs_code(self):
        out, tag = self.stage2()
        torch.save({"optimizer_state_dict": RunsCode()}, self.optim(tag, 2))
        self.expect_error(out, "InvalidArgument", "zero_pp_rank_2", "system")

    def test_missing_rank(self):
        out, tag = self.stage2(world=3)
        os.remove(self.optim(tag, 1))
        self.expect_error(out, "DataLoss", "(missing: 1)")

    def test_extra_rank(self):
        out, tag = self.stage2(world=3)
        shutil.copy(self.optim(tag, 2), self.optim(tag, 3))
        self.expect_error(out, "DataLoss", "partition_count']: 3, but the checkpoint has 4")

    def test_names_deepspeed_does_not_write(self):
        for name in ("zero_pp_rank_01_mp_rank_00_optim_states.pt",
                     "bf16_zero_pp_rank_1_mp_rank_00_model_states.pt",
                     "zero_pp_rank_x_mp_rank_00_optim_states.pt"):
            with self.subTest(name=name):
                out, tag = self.stage2(world=2)
                shutil.copy(self.optim(tag, 1), os.path.join(tag, name))
                self.expect_error(out, "DataLoss", name, "not as DeepSpeed names its files")
        out, tag = self.stage2(world=2)
        shutil.copy(self.optim(tag, 1),
                    os.path.join(tag, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        self.expect_error(out, "DataLoss", "two prefixes")

    def test_mismatched_partition_count(self):
        out, tag = self.stage2(world=3)
        sd = torch.load(self.optim(tag, 1))
        sd["optimizer_state_dict"]["partition_count"] = [4, 4]
        torch.save(sd, self.optim(tag, 1))
        self.expect_error(out, "DataLoss", "zero_pp_rank_1", "partition_count']: 4")

    def test_step_is_not_global_minus_skipped(self):
        out, tag = self.stage2()
        path = os.path.join(tag, "mp_rank_00_model_states.pt")
        ms = torch.load(path)
        ms["global_steps"], ms["skipped_steps"] = 9, 1
        ms["lr_scheduler"] = {"last_batch_iteration": 7}
        torch.save(ms, path)
        self.expect_error(out, "DataLoss", "step is 7", "global_steps 9 - skipped_steps 1 = 8")
        ms["global_steps"], ms["skipped_steps"] = 7, 0  # the steps fit, the scheduler does not
        torch.save(ms, path)
        self.expect_error(out, "DataLoss", "last_batch_iteration 7", "- 1 = 6")

    def test_nan_in_exp_avg(self):
        out, tag = self.stage2(world=2)
        sd = torch.load(self.optim(tag, 1))
        sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][0] = math.nan
        torch.save(sd, self.optim(tag, 1))
        # Rank 1's first element of group 0 is element 14 of [a.weight, a.bias, b.weight].
        self.expect_error(out, "DataLoss", "param 'a.weight' exp_avg: element 14 is nan")

    def test_model_parallel_files(self):
        out, tag = self.stage2()
        shutil.copy(os.path.join(tag, "mp_rank_00_model_states.pt"),
                    os.path.join(tag, "mp_rank_01_model_states.pt"))
        self.expect_error(out, "InvalidArgument", "mp_rank_01_model_states.pt", "model-parallel")
        os.remove(os.path.join(tag, "mp_rank_01_model_states.pt"))
        shutil.copy(self.optim(tag, 0), os.path.join(tag, "layer_01-model_states.pt"))
        self.expect_error(out, "InvalidArgument", "layer_01-model_states.pt", "pipeline")

    def test_latest_escaping(self):
        for text in ("../x", "/etc", "..", "a/b", ""):
            with self.subTest(latest=text):
                out, _ = self.stage2(world=1)
                with open(os.path.join(out, "latest"), "w") as f:
                    f.write(text)
                self.expect_error(out, "InvalidArgument", "is not a tag")

    def test_latest_and_tag_not_links(self):
        out, tag = self.stage2(world=1)
        os.rename(tag, os.path.join(self.tmp.name, "real_tag"))
        os.symlink(os.path.join(self.tmp.name, "real_tag"), tag)
        self.expect_error(out, "FailedPrecondition", "global_step7")
        os.remove(tag)
        os.rename(os.path.join(self.tmp.name, "real_tag"), tag)
        self.dump(out)
        latest = os.path.join(out, "latest")
        os.rename(latest, os.path.join(self.tmp.name, "latest_elsewhere"))
        os.symlink(os.path.join(self.tmp.name, "latest_elsewhere"), latest)
        self.expect_error(out, "FailedPrecondition", "latest", "symbolic link")
        os.remove(latest)
        with open(latest, "w") as f:
            f.write("global_step7" + " " * 5000)
        self.expect_error(out, "InvalidArgument", "larger than 4096")

    def test_ds_config_json_cannot_hold(self):
        for bad, needle in ((float("inf"), "inf, which JSON cannot hold"),
                            (torch.zeros(2), "a tensor, which JSON cannot hold"),
                            ({1: 2}, "a int key")):
            with self.subTest(bad=repr(bad)):
                out, tag = self.stage2(world=1)
                sd = torch.load(self.optim(tag, 0))
                sd["ds_config"] = dict(CONFIG, bad=bad)
                torch.save(sd, self.optim(tag, 0))
                self.expect_error(out, "InvalidArgument", "['ds_config']['bad']", needle)

    def test_symlinked_optim_file(self):
        out, tag = self.stage2(world=2)
        real = os.path.join(self.tmp.name, "elsewhere.pt")
        shutil.move(self.optim(tag, 1), real)
        os.symlink(real, self.optim(tag, 1))
        self.expect_error(out, "FailedPrecondition", "zero_pp_rank_1", "symbolic link")

    def test_broken_storage_crc(self):
        out, tag = self.stage2(world=2)
        flip_storage_byte(self.optim(tag, 0))
        self.expect_error(out, "DataLoss", "zero_pp_rank_0", "CRC-32")

    def test_tensor_lengths_and_mappings_checked(self):
        out, tag = self.stage2(world=2)
        sd = torch.load(self.optim(tag, 1))
        osd = sd["optimizer_state_dict"]
        fp32 = osd["single_partition_of_fp32_groups"]
        good = fp32[0]
        fp32[0] = good[:-1].clone()
        torch.save(sd, self.optim(tag, 1))
        self.expect_error(out, "DataLoss", "single_partition_of_fp32_groups'][0]",
                          "12 elements, the layout gives 13")
        fp32[0] = good
        maps = osd["param_slice_mappings"][0]
        osd["param_slice_mappings"][0] = collections.OrderedDict(reversed(list(maps.items())))
        torch.save(sd, self.optim(tag, 1))
        self.expect_error(out, "DataLoss", "param_slice_mappings'][0]", "round_robin_gradients")
        osd["param_slice_mappings"][0] = maps
        osd["base_optimizer_state"]["state"][1]["max_exp_avg_sq"] = torch.zeros(4)
        torch.save(sd, self.optim(tag, 1))
        self.expect_error(out, "InvalidArgument", "optimizer state 'max_exp_avg_sq'")

    def test_stage3_lengths_and_ranks(self):
        out = self.new_dir()
        write_stage3(out, 3)
        tag = os.path.join(out, "global_step5")
        os.remove(os.path.join(tag, "zero_pp_rank_2_mp_rank_00_model_states.pt"))
        self.expect_error(out, "DataLoss", "model files", "(missing: 2)")
        out = self.new_dir()
        write_stage3(out, 3)
        tag = os.path.join(out, "global_step5")
        sd = torch.load(self.optim(tag, 1))
        sd["optimizer_state_dict"]["fp32_flat_groups"][1] = torch.zeros(3)
        torch.save(sd, self.optim(tag, 1))
        # Sub-group 1: ceil(7/3) + ceil(4/3) + ceil(1/3) = 3 + 2 + 1 elements per rank.
        self.expect_error(out, "DataLoss", "fp32_flat_groups'][1]",
                          "3 elements, the layout gives 6")

    def test_order_falls_back_to_param_shapes_and_dtype_is_uniform(self):
        out, tag = self.stage2(world=2)
        path = os.path.join(tag, "mp_rank_00_model_states.pt")
        ms = torch.load(path)
        del ms["module"]["b.weight"]
        torch.save(ms, path)
        js = self.dump(out)
        self.assertEqual([p["name"] for p in js["params"]],
                         ["a.weight", "a.bias", "b.weight", "c.weight", "c.bias"])
        self.assertTrue(all(p["dtype"] == "float16" for p in js["params"]))
        ms["module"]["a.bias"] = ms["module"]["a.bias"].float()
        torch.save(ms, path)
        self.expect_error(out, "InvalidArgument", "'a.bias' as float32", "one dtype")

    def test_frozen_params_and_universal(self):
        out, tag = self.stage2(world=1)
        path = os.path.join(tag, "mp_rank_00_model_states.pt")
        ms = torch.load(path)
        ms["frozen_param_shapes"] = collections.OrderedDict([("emb", torch.Size([4]))])
        torch.save(ms, path)
        self.expect_error(out, "InvalidArgument", "1 frozen parameters (emb)")
        os.makedirs(os.path.join(tag, "zero"))
        with open(os.path.join(tag, "zero", "optimizer_state.pt"), "w"):
            pass
        self.expect_error(out, "DataLoss", "optim_states.pt) beside a universal checkpoint")

    def test_client_state(self):
        out = self.new_dir()
        write_stage12(out, 2)
        path = os.path.join(out, "global_step7", "mp_rank_00_model_states.pt")
        ms = torch.load(path)
        ms.update(CLIENT, my_tensor=torch.zeros(2))
        torch.save(ms, path)
        js = self.dump(out)
        want = json.loads(json.dumps(CLIENT))  # tuples as lists
        self.assertEqual(js["client_state"], want)
        self.assertEqual(js["client_state_skipped"], ["my_tensor"])
        # A universal folder's copied model file gives the same.
        out = self.new_dir()
        write_universal12(out, 2, my_tensor=torch.zeros(2), **CLIENT)
        js = self.dump(out)
        self.assertEqual(js["client_state"], want)
        self.assertEqual(js["client_state_skipped"], ["my_tensor"])

    # ---- universal folders ----
    def test_universal_from_stage1_and_2(self):
        order = [n for n in MODULE_ORDER if n in make_values(GROUPS, 0)]
        for stage, world, step_kind in ((2, 1, "int"), (1, 2, "tensor"), (2, 3, "int64")):
            with self.subTest(stage=stage, world=world, step=step_kind):
                out = self.new_dir()
                vals = write_universal12(out, world, stage=stage, seed=40 + world,
                                         step_kind=step_kind)
                js = self.dump(out)
                self.assertTrue(js["universal"])
                self.assertEqual((js["stage"], js["world_size"]), (stage, world))
                self.assertFalse(js["bf16_optimizer"])
                self.assertFalse(js["elastic"])
                self.assertEqual((js["global_steps"], js["skipped_steps"]), (7, 0))
                self.assertEqual(js["scheduler_last_batch_iteration"], 6)
                self.assertEqual(js["loss_scaler"]["kind"], "static")
                self.assertEqual(js["ds_config"], CONFIG)
                self.assertEqual(js["shared_params"], [["lm_head.weight", "a.weight"]])
                self.assertEqual([g["lr"] for g in js["optimizer_groups"]], [1e-3, 2e-3])
                self.assertEqual({p["name"]: p["group"] for p in js["params"]},
                                 {"a.weight": 0, "a.bias": 0, "b.weight": 0,
                                  "c.weight": 1, "c.bias": 1})
                self.check_values(js, vals, order)
                uc = os.path.join(out, "global_step7_universal")
                self.assertEqual(self.dump(uc), js)  # the folder itself reads the same

    def test_universal_fp16_scaler_skipped_steps(self):
        out = self.new_dir()
        scaler = DynamicLossScaler(2.0 ** 13, 10, 6, 1)
        vals = write_universal12(out, 2, global_steps=10, skipped=2, scaler=scaler, seed=45,
                                 step_kind="tensor")
        js = self.dump(out)
        self.assertEqual((js["global_steps"], js["skipped_steps"]), (10, 2))
        self.assertEqual(js["scheduler_last_batch_iteration"], 7)
        self.assertEqual(js["loss_scaler"]["kind"], "dynamic")
        self.assertEqual(js["loss_scaler"]["scale"], 8192.0)
        self.check_values(js, vals, [n for n in MODULE_ORDER if n in vals])

    def test_universal_from_stage3(self):
        for world in (1, 3):
            with self.subTest(world=world):
                out = self.new_dir()
                vals = write_universal3(out, world, seed=50 + world)
                js = self.dump(out)
                self.assertTrue(js["universal"])
                self.assertEqual((js["stage"], js["world_size"]), (3, world))
                self.assertEqual(js["global_steps"], 5)
                self.assertEqual(len(js["optimizer_groups"]), 1)
                self.assertEqual(js["optimizer_groups"][0]["lr"], 2e-3)
                self.assertTrue(all(p["group"] == 0 for p in js["params"]))
                self.check_values(js, vals, [n for n in MODULE_ORDER if n in vals])
                self.assertEqual(self.dump(os.path.join(out, "global_step5_universal")), js)

    def universal(self, **kw):
        out = self.new_dir()
        write_universal12(out, 2, **kw)
        uc = os.path.join(out, "global_step7_universal")
        return out, uc, os.path.join(uc, "zero")

    def test_universal_param_folders(self):
        out, uc, zero = self.universal()
        shutil.rmtree(os.path.join(zero, "a.bias"))
        self.expect_error(out, "NotFound", "param 'a.bias'")
        out, uc, zero = self.universal()
        os.makedirs(os.path.join(zero, "extra.weight"))
        self.expect_error(out, "DataLoss", "extra.weight not among the params of")
        out, uc, zero = self.universal()
        real = os.path.join(self.tmp.name, "elsewhere")
        shutil.move(os.path.join(zero, "a.bias"), real)
        os.symlink(real, os.path.join(zero, "a.bias"))
        self.expect_error(out, "FailedPrecondition", "a.bias", "symbolic link")
        out, uc, zero = self.universal()
        real = os.path.join(self.tmp.name, "elsewhere.pt")
        shutil.move(os.path.join(zero, "c.bias", "exp_avg.pt"), real)
        os.symlink(real, os.path.join(zero, "c.bias", "exp_avg.pt"))
        self.expect_error(out, "FailedPrecondition", "c.bias/exp_avg.pt", "symbolic link")
        out, uc, zero = self.universal()
        torch.save({"param": torch.zeros(5), "cat_dim": 0},
                   os.path.join(zero, "a.bias", "max_exp_avg_sq.pt"))
        self.expect_error(out, "InvalidArgument", "a.bias: max_exp_avg_sq.pt")
        os.remove(os.path.join(zero, "a.bias", "step.pt"))
        os.remove(os.path.join(zero, "a.bias", "max_exp_avg_sq.pt"))
        self.expect_error(out, "NotFound", "a.bias/step.pt")

    def test_universal_names_that_are_not_folders(self):
        for bad in ("..", "a/b", "."):
            with self.subTest(name=bad):
                groups = [collections.OrderedDict([("a.weight", (3, 5)), (bad, (5,))])]
                # Such a param cannot have its own folder: the model file names it.
                vals = make_values(groups, 1)
                uc = os.path.join(self.new_dir(), "uc")
                os.makedirs(os.path.join(uc, "zero", "a.weight"))
                torch.save(model_states(groups, vals, 7, 0),
                           os.path.join(uc, "mp_rank_00_model_states.pt"))
                torch.save({"zero_stage": 2, "partition_count": [1], "ds_version": "0.19.6",
                            "param_groups": [adam_group(1e-3, [0])]},
                           os.path.join(uc, "zero", "optimizer_state.pt"))
                self.expect_error(uc, "InvalidArgument", "is not a folder name")

    def test_latest_universal(self):
        for text in ("..", "../x", "a/b", ""):
            with self.subTest(latest_universal=text):
                out, _, _ = self.universal()
                with open(os.path.join(out, "latest_universal"), "w") as f:
                    f.write(text)
                self.expect_error(out, "InvalidArgument", "latest_universal", "is not a tag")
        out, uc, _ = self.universal()
        latest = os.path.join(out, "latest_universal")
        os.rename(latest, os.path.join(self.tmp.name, "lu_elsewhere"))
        os.symlink(os.path.join(self.tmp.name, "lu_elsewhere"), latest)
        self.expect_error(out, "FailedPrecondition", "latest_universal", "symbolic link")
        os.remove(latest)
        os.rename(uc, os.path.join(self.tmp.name, "uc_elsewhere"))
        os.symlink(os.path.join(self.tmp.name, "uc_elsewhere"), uc)
        with open(latest, "w") as f:
            f.write("global_step7_universal")
        self.expect_error(out, "FailedPrecondition", "global_step7_universal")
        # Both pointers: which one is meant is not for zinf to guess.
        out, uc, _ = self.universal()
        with open(os.path.join(out, "latest"), "w") as f:
            f.write("global_step7_universal")
        self.expect_error(out, "InvalidArgument", "both latest and latest_universal")
        self.dump(uc)
        # latest_universal naming a ZeRO tag folder.
        out = self.new_dir()
        write_stage12(out, 1)
        with open(os.path.join(out, "latest_universal"), "w") as f:
            f.write("global_step7")
        os.remove(os.path.join(out, "latest"))
        self.expect_error(out, "NotFound", "latest_universal", "not a universal checkpoint")

    def test_universal_steps(self):
        out, uc, zero = self.universal(step_kind="tensor")
        torch.save(torch.tensor(8.0), os.path.join(zero, "c.weight", "step.pt"))
        self.expect_error(out, "DataLoss", "c.weight/step.pt: step 8, but", "step.pt has 7")
        for name in ("a.weight", "a.bias", "b.weight", "c.bias"):
            torch.save(8, os.path.join(zero, name, "step.pt"))
        self.expect_error(out, "DataLoss", "step is 8",
                          "global_steps 7 - skipped_steps 0 = 7")
        out = self.new_dir()
        write_universal3(out, 2)
        path = os.path.join(out, "global_step5_universal", "zero", "optimizer_state.pt")
        sd = torch.load(path)
        sd["optimizer_state_dict"]["state"][1]["step"] = 4
        torch.save(sd, path)
        self.expect_error(out, "DataLoss", "['state'][1]['step']: step 4, but")

    def test_universal_param_files(self):
        for key in ("vocab_tensor", "param_n_sub_params", "sub_param_shape", "is_expert_param"):
            with self.subTest(key=key):
                out, uc, zero = self.universal()
                path = os.path.join(zero, "a.weight", "fp32.pt")
                d = torch.load(path)
                d[key] = True
                torch.save(d, path)
                self.expect_error(out, "InvalidArgument", "a.weight/fp32.pt", f"key '{key}'",
                                  "tensor- or expert-parallel")
        out, uc, zero = self.universal()
        torch.save({"param": torch.zeros(4), "cat_dim": 0},
                   os.path.join(zero, "a.bias", "exp_avg_sq.pt"))
        self.expect_error(out, "DataLoss", "a.bias/exp_avg_sq.pt['param']", "(4 elements)",
                          "param_shapes gives 5")
        out, uc, zero = self.universal()
        path = os.path.join(zero, "a.weight", "exp_avg.pt")
        d = torch.load(path)
        d["param"][0, 3] = math.nan
        torch.save(d, path)
        self.expect_error(out, "DataLoss", "param 'a.weight' exp_avg: element 3 is nan")
        out, uc, zero = self.universal()
        path = os.path.join(zero, "a.weight", "exp_avg_sq.pt")
        d = torch.load(path)
        d["param"][1, 0] = -1.0
        torch.save(d, path)
        self.expect_error(out, "DataLoss", "param 'a.weight' exp_avg_sq: element 5 is -1",
                          "negative")
        out, uc, zero = self.universal()
        torch.save({"param": RunsCode(), "cat_dim": 0}, os.path.join(zero, "b.weight", "fp32.pt"))
        self.expect_error(out, "InvalidArgument", "b.weight/fp32.pt", "system")
        out, uc, zero = self.universal()
        flip_storage_byte(os.path.join(zero, "c.weight", "exp_avg_sq.pt"))
        self.expect_error(out, "DataLoss", "c.weight/exp_avg_sq.pt", "CRC-32")
        out = self.new_dir()
        write_universal3(out, 2)
        zero = os.path.join(out, "global_step5_universal", "zero")
        torch.save(torch.zeros(6), os.path.join(zero, "b.weight", "fp32.pt"))
        self.expect_error(out, "DataLoss", "b.weight/fp32.pt", "6 elements, the layout gives 7")
        torch.save({"param": torch.zeros(7), "cat_dim": 0},
                   os.path.join(zero, "b.weight", "fp32.pt"))
        self.expect_error(out, "DataLoss", "b.weight/fp32.pt", "a dict, not a tensor")

    def test_universal_world_and_model_files(self):
        out, uc, zero = self.universal()
        path = os.path.join(zero, "optimizer_state.pt")
        sd = torch.load(path)
        sd["partition_count"] = [2, 3]
        torch.save(sd, path)
        self.expect_error(out, "DataLoss", "partition_count']: 3, not a world size")
        out = self.new_dir()
        write_universal3(out, 3)
        uc = os.path.join(out, "global_step5_universal")
        os.remove(os.path.join(uc, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
        self.expect_error(out, "DataLoss", "model files", "(missing: 1)")
        out, uc, zero = self.universal()
        shutil.copy(os.path.join(uc, "mp_rank_00_model_states.pt"),
                    os.path.join(uc, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        self.expect_error(out, "DataLoss", "beside a universal checkpoint")


def main():
    global TOOL
    if len(sys.argv) < 2:
        print("usage: deepspeed_read_test.py DEEPSPEED_READ_TOOL", file=sys.stderr)
        return 2
    TOOL = sys.argv[1]
    prog = unittest.main(argv=[sys.argv[0], *sys.argv[2:]], exit=False, verbosity=2)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
