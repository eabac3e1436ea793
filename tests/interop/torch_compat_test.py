#!/usr/bin/python3
"""torch files between torch and zinf (interop/torch_file.h), through torch_file_tool.

Run by CTest: /usr/bin/python3 torch_compat_test.py TORCH_FILE_TOOL. Exit 77 (skipped) when
torch cannot be imported.
  - torch.save of varied trees (fp32/fp16/bf16, views with storage offsets, shared storages,
    OrderedDict, torch.Size, nested containers) -> `torch_file_tool dump` -> the same tree,
    tensor values bitwise;
  - `torch_file_tool write` -> torch.load -> the expected tree, bitwise;
  - DeepSpeed-like files (param_shapes, fragment_address, LossScaler objects pickled from fake
    `deepspeed.*` modules, fake_deepspeed.py) -> dump shows them as objects with their state;
  - hostile files (truncated, a broken CRC, a pickle naming os.system, torch's legacy format, a
    storage entry too short or missing) -> exit 1 with a message naming the defect.
"""

import collections
import enum
import json
import math
import os
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
from fake_deepspeed import (  # noqa: E402
    DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address)

TOOL = None  # set from argv in main


def run_tool(*args):
    return subprocess.run([TOOL, *args], capture_output=True, text=True, timeout=60)


def dump(path):
    r = run_tool("dump", path)
    if r.returncode != 0:
        raise AssertionError(f"dump {path} exited {r.returncode}: {r.stderr}")
    return json.loads(r.stdout)


def f32_bits(t):
    """The elements of tensor t (any float dtype), widened to fp32, as 8-hex-digit strings."""
    flat = t.detach().contiguous().reshape(-1).float()
    return [f"{v & 0xFFFFFFFF:08x}" for v in flat.view(torch.int32).tolist()]


def storage_numel(t):
    return t.storage().size()


# ---- the JSON of torch_file_tool dump (see torch_file_tool.cc) against a Python value ----
def check_json(case, value, js, where="root"):
    """Asserts that the dump's JSON `js` is exactly the Python value `value`."""
    msg = f"at {where}: {value!r:.200} vs {js!r:.200}"
    if value is None:
        case.assertIsNone(js, msg)
    elif isinstance(value, bool):
        case.assertIs(js, value, msg)
    elif isinstance(value, enum.Enum):
        # Python 3.11 pickles an IntEnum member as getattr(Class, name); zinf reads
        # ZeroStageEnum as its int value.
        case.assertEqual(js, int(value), msg)
    elif isinstance(value, int):
        case.assertIsInstance(js, int, msg)
        case.assertNotIsInstance(js, bool, msg)
        case.assertEqual(js, value, msg)
    elif isinstance(value, float):
        case.assertEqual(js, {"float": struct.pack(">d", value).hex()}, msg)
    elif isinstance(value, str):
        case.assertEqual(js, value, msg)
    elif isinstance(value, list):
        case.assertIsInstance(js, list, msg)
        case.assertEqual(len(js), len(value), msg)
        for i, (v, j) in enumerate(zip(value, js)):
            check_json(case, v, j, f"{where}[{i}]")
    elif isinstance(value, torch.Size):
        case.assertEqual(js, {"size": list(value)}, msg)
    elif isinstance(value, tuple):
        case.assertEqual(list(js.keys()), ["tuple"], msg)
        case.assertEqual(len(js["tuple"]), len(value), msg)
        for i, (v, j) in enumerate(zip(value, js["tuple"])):
            check_json(case, v, j, f"{where}[{i}]")
    elif isinstance(value, dict):
        tag = "odict" if isinstance(value, collections.OrderedDict) else "dict"
        case.assertEqual(list(js.keys()), [tag], msg)
        case.assertEqual(len(js[tag]), len(value), msg)
        for (k, v), (jk, jv) in zip(value.items(), js[tag]):
            check_json(case, k, jk, f"{where}<key {k!r}>")
            check_json(case, v, jv, f"{where}[{k!r}]")
    elif isinstance(value, torch.Tensor):
        case.assertEqual(list(js.keys()), ["tensor"], msg)
        t = js["tensor"]
        case.assertEqual(t["dtype"], str(value.dtype).removeprefix("torch."), msg)
        case.assertEqual(t["shape"], list(value.shape), msg)
        case.assertEqual(t["stride"], list(value.stride()), msg)
        case.assertEqual(t["offset"], value.storage_offset(), msg)
        case.assertEqual(t["storage_numel"], storage_numel(value), msg)
        case.assertEqual(t["requires_grad"], value.requires_grad, msg)
        if not value.is_contiguous():
            case.assertIsNone(t["values"], msg)
        elif value.dtype in (torch.float32, torch.float16, torch.bfloat16):
            case.assertEqual(t["values"], f32_bits(value), msg)
        elif value.dtype == torch.int64:
            case.assertEqual(t["values"], value.reshape(-1).tolist(), msg)
        else:
            case.assertIsNone(t["values"], msg)
    elif isinstance(value, torch.dtype):
        case.assertEqual(js, {"dtype": str(value).removeprefix("torch.")}, msg)
    elif hasattr(value, "__dict__"):
        cls = type(value)
        case.assertEqual(js.get("object"), f"{cls.__module__}.{cls.__qualname__}", msg)
        check_json(case, dict(value.__dict__), js["state"], f"{where}.__dict__")
    else:
        raise AssertionError(f"{where}: no rule for {type(value)}")


def storage_keys(js, out):
    """Every tensor of a dump, in order: (storage key, offset)."""
    if isinstance(js, list):
        for j in js:
            storage_keys(j, out)
    elif isinstance(js, dict):
        if "tensor" in js:
            out.append((js["tensor"]["storage"], js["tensor"]["offset"]))
        else:
            for v in js.values():
                storage_keys(v, out)
    return out


def deepspeed_trees():
    torch.manual_seed(46)
    a = torch.randn(2, 3)
    b = torch.randn(4)
    model = {
        "module": collections.OrderedDict([("a", a.half()), ("b", b.half())]),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [collections.OrderedDict([("a", torch.Size([2, 3])),
                                                  ("b", torch.Size([4]))])],
        "frozen_param_shapes": None,
        "shared_params": {},
        "lr_scheduler": {"last_batch_iteration": 4},
        "global_steps": 5,
        "skipped_steps": 0,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": "0.19.6",
        "universal_checkpoint_info": {"universal_checkpoint_version": 0.4},
    }
    flat = torch.cat([a.reshape(-1), b, torch.zeros(2)])  # 10 + 2 padding
    optim = {
        "optimizer_state_dict": {
            "loss_scaler": DynamicLossScaler(65536, 12, 3, 2),
            "dynamic_loss_scale": True,
            "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(12),
                              "exp_avg_sq": torch.rand(12)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                  "weight_decay": 0.0, "amsgrad": False, "params": [0]}],
            },
            "single_partition_of_fp32_groups": [flat[:10]],
            "zero_stage": 2,
            "group_paddings": [2],
            "partition_count": [1],
            "ds_version": "0.19.6",
            "param_slice_mappings": [collections.OrderedDict([
                ("a", fragment_address(numel=6, start=0)),
                ("b", fragment_address(numel=4, start=6))])],
        },
        "ds_config": {"train_batch_size": 8, "fp16": {"enabled": True}},
        "ds_version": "0.19.6",
    }
    static = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
              "step": 7}
    return {"model_states": model, "optim_states": optim, "static_scaler": static}


class TorchCompat(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="zinf_torch_compat_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def save(self, obj, name, **kw):
        p = self.path(name)
        torch.save(obj, p, **kw)
        return p

    def check_round_trip(self, obj, name):
        js = dump(self.save(obj, name))
        check_json(self, obj, js)
        return js

    # ---- torch.save -> dump ----
    def test_dtypes_and_special_values(self):
        torch.manual_seed(1)
        special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, 1e-40,
                                3.4028234e38, -1.5, 65504.0, 6e-8, 1e-5])
        tree = {
            "w32": torch.randn(3, 5),
            "w16": torch.randn(4, 3).half(),
            "bf16": torch.randn(7).bfloat16(),
            "special32": special,
            "special16": special.half(),
            "specialbf": special.bfloat16(),
            "all16": torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.float16),
            "allbf": torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
            "scalar": torch.tensor(2.5),
            "i64": torch.arange(6).reshape(2, 3) - 3,
            "step": torch.tensor(9),
            "empty": torch.zeros(0, 4),
            "f64": torch.randn(3, dtype=torch.float64),
            "grad": torch.ones(2, requires_grad=True),
        }
        self.check_round_trip(tree, "dtypes.pt")

    def test_views_and_shared_storages(self):
        big = torch.arange(40, dtype=torch.float32) * 1.5
        half = big.half()
        tree = {
            "row": big.view(5, 8)[2],
            "slice": big[3:11],
            "rows": big.view(5, 8)[1:3],
            "transposed": big.view(5, 8).t(),
            "whole": big,
            "half_slice": half[5:9],
            "half_whole": half,
            "tail_empty": big[40:],
        }
        js = self.check_round_trip(tree, "views.pt")
        keys = storage_keys(js, [])
        self.assertEqual(len({k for k, _ in keys[:5] + keys[7:]}), 1, keys)
        self.assertEqual(keys[5][0], keys[6][0])
        self.assertNotEqual(keys[0][0], keys[5][0])
        self.assertEqual([o for _, o in keys], [16, 3, 8, 0, 0, 5, 0, 40])

    def test_containers(self):
        tree = collections.OrderedDict([
            ("size", torch.Size([3, 1, 4])),
            ("empty_size", torch.Size([])),
            ("nested", [[1, [2, [3, []]]], (4, (5,)), {"x": {"y": [None, True, False]}}]),
            ("ints", [0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, -2**31, 2**40, -2**63,
                      2**63 - 1]),
            ("floats", [0.0, -0.0, 0.1, 1e300, -1e-300, math.inf, -math.inf, 5e-324]),
            ("str", "zinf ünïcode ✓"),
            ("empty_str", ""),
            ("int_keys", {1: "a", -2: "b"}),
            ("tuple_key", {(1, "x"): 3}),
            ("shapes", [collections.OrderedDict([("w", torch.Size([2, 2]))])]),
            ("tensor_in_list", [torch.ones(2), (torch.zeros(1),)]),
            ("dtype", torch.float16),
        ])
        self.check_round_trip(tree, "containers.pt")

    def test_bare_tensor_root(self):
        self.check_round_trip(torch.arange(5, dtype=torch.float32), "bare.pt")

    # ---- DeepSpeed-like files ----
    def test_deepspeed_like_files(self):
        trees = deepspeed_trees()
        fake_deepspeed.register()  # for torch.save to write the objects' classes by name
        paths = {name: self.save(tree, f"{name}.pt") for name, tree in trees.items()}
        for name, tree in trees.items():
            with self.subTest(file=name):
                js = dump(paths[name])
                check_json(self, tree, js)
        js = dump(paths["optim_states"])
        osd = dict(js["dict"])["optimizer_state_dict"]
        mappings = dict(osd["dict"])["param_slice_mappings"]
        self.assertEqual(mappings[0]["odict"][0][1], {
            "object": "deepspeed.utils.tensor_fragment.fragment_address",
            "state": {"dict": [["numel", 6], ["start", 0]]}})
        scaler = dict(osd["dict"])["loss_scaler"]
        self.assertEqual(scaler["object"], "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")
        self.assertIn(["dtype", {"dtype": "float16"}], scaler["state"]["dict"])

    # ---- zinf writes -> torch.load ----
    def test_written_file_loads_in_torch(self):
        p = self.path("written.pt")
        r = run_tool("write", p)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = torch.load(p)
        assert_same(self, expected_sample(), got)
        with zipfile.ZipFile(p) as z:
            self.assertIsNone(z.testzip())
            self.assertEqual(z.read("archive/version"), b"3\n")
            self.assertIn("archive/data.pkl", z.namelist())
            names = z.namelist()
        # Storages 64-byte aligned, as torch writes them (torch >= 2.1 maps them in place).
        for name in names:
            if name.startswith("archive/data/"):
                self.assertEqual(self.entry_data_offset(p, name) % 64, 0, name)
        # And zinf reads back what it wrote.
        check_json(self, got, dump(p))

    # ---- hostile files ----
    def base_file(self):
        return self.save({"w": torch.arange(16, dtype=torch.float32),
                          "h": torch.arange(8, dtype=torch.float32).half()}, "base.pt")

    def expect_failure(self, path, *needles, code="DataLoss"):
        r = run_tool("dump", path)
        self.assertEqual(r.returncode, 1, f"rc {r.returncode}, stderr: {r.stderr}")
        self.assertEqual(r.stdout, "")
        self.assertIn(code, r.stderr)
        for needle in needles:
            self.assertIn(needle, r.stderr)
        return r.stderr

    def rewrite_zip(self, src, dst, change):
        """Copies the zip src to dst (stored), entry by entry through change(name, data)."""
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = change(info.filename, zin.read(info.filename))
                if data is not None:
                    zout.writestr(info.filename, data)

    def test_truncated(self):
        src = self.base_file()
        with open(src, "rb") as f:
            data = f.read()
        for size in [0, 1, 3, 30, 100, len(data) // 2, len(data) - 23, len(data) - 22,
                     len(data) - 1]:
            with self.subTest(size=size):
                p = self.path(f"trunc_{size}.pt")
                with open(p, "wb") as f:
                    f.write(data[:size])
                self.expect_failure(p, p)

    def entry_data_offset(self, path, name):
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(name)
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len

    def test_broken_crc(self):
        src = self.base_file()
        for entry in ["base/data/0", "base/data/1", "base/data.pkl"]:
            with self.subTest(entry=entry):
                with open(src, "rb") as f:
                    data = bytearray(f.read())
                off = self.entry_data_offset(src, entry)
                data[off + 1] ^= 0x01
                p = self.path("crc.pt")
                with open(p, "wb") as f:
                    f.write(data)
                err = self.expect_failure(p, p)
                self.assertIn("crc", err.lower())

    def test_pickle_naming_os_system(self):
        marker = self.path("pwned")
        cmd = f"touch {marker}".encode()
        evil = (b"\x80\x02cos\nsystem\nq\x00X" + struct.pack("<I", len(cmd)) + cmd +
                b"q\x01\x85q\x02Rq\x03.")
        for module, pkl in [("os.system", evil),
                            ("posix.system", evil.replace(b"cos\n", b"cposix\n"))]:
            with self.subTest(module=module):
                p = self.path("evil.pt")
                with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
                    z.writestr("evil/data.pkl", pkl)
                    z.writestr("evil/version", b"3\n")
                self.expect_failure(p, module, code="InvalidArgument")
                self.assertFalse(os.path.exists(marker))

    def test_legacy_format(self):
        p = self.save({"w": torch.ones(3)}, "legacy.pt", _use_new_zipfile_serialization=False)
        self.expect_failure(p, p, "legacy", "_use_new_zipfile_serialization=True",
                            code="InvalidArgument")

    def test_storage_too_short(self):
        src = self.base_file()
        p = self.path("short.pt")
        self.rewrite_zip(src, p, lambda n, d: d[:-4] if n == "base/data/0" else d)
        self.expect_failure(p, p, "base/data/0", "60 bytes")

    def test_storage_missing(self):
        src = self.base_file()
        p = self.path("missing.pt")
        self.rewrite_zip(src, p, lambda n, d: None if n == "base/data/1" else d)
        self.expect_failure(p, p, "base/data/1", "missing")

    def test_storage_too_long(self):
        src = self.base_file()
        p = self.path("long.pt")
        self.rewrite_zip(src, p, lambda n, d: d + b"\0\0" if n == "base/data/1" else d)
        self.expect_failure(p, p, "base/data/1")


def expected_sample():
    """The tree `torch_file_tool write` saves (SampleTree in torch_file_tool.cc)."""
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0])
    bias.view(torch.int32)[:] = torch.tensor([0x80000000 - 2**32, 0x00000001, 0x7F800000,
                                             0x7FC00001], dtype=torch.int32)
    return {
        "model": collections.OrderedDict([
            ("embed.weight", (torch.arange(12, dtype=torch.float32) * 0.25 - 1.5).reshape(3, 4)),
            ("embed.bias", bias),
            ("scale", torch.tensor(3.5)),
            ("empty", torch.zeros(0, 3)),
            ("cube", ((torch.arange(12, dtype=torch.float32) + 1) / 3.0).reshape(2, 3, 2)),
        ]),
        "shape": torch.Size([3, 4]),
        "step": torch.tensor(7),
        "ids": torch.tensor([1, -2, 1 << 40]),
        "ints": [0, -1, 1 << 40, -2**63, 2**63 - 1],
        "floats": [0.1, -2.5, 1e300, math.inf, -0.0],
        "name": "zinf ünïcode ✓",
        "flags": (True, False, None),
        "nested": [[1, 2], {"a": 1.5, 3: "three"}, []],
    }


def assert_same(case, want, got, where="root"):
    """want == got exactly: the same types (OrderedDict, torch.Size), floats and tensors bitwise."""
    msg = f"at {where}: want {want!r:.200}, got {got!r:.200}"
    case.assertIs(type(got), type(want), msg)
    if isinstance(want, torch.Tensor):
        case.assertEqual(got.dtype, want.dtype, msg)
        case.assertEqual(got.shape, want.shape, msg)
        case.assertEqual(got.stride(), want.stride(), msg)
        case.assertEqual(got.storage_offset(), 0, msg)
        case.assertEqual(storage_numel(got), got.numel(), msg)
        case.assertFalse(got.requires_grad, msg)
        if want.is_floating_point():
            case.assertEqual(f32_bits(got), f32_bits(want), msg)
        else:
            case.assertEqual(got.tolist(), want.tolist(), msg)
    elif isinstance(want, dict):
        case.assertEqual(list(got.keys()), list(want.keys()), msg)
        for k in want:
            assert_same(case, want[k], got[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        case.assertEqual(len(got), len(want), msg)
        for i, (w, g) in enumerate(zip(want, got)):
            assert_same(case, w, g, f"{where}[{i}]")
    elif isinstance(want, float):
        case.assertEqual(struct.pack("<d", got), struct.pack("<d", want), msg)
    else:
        case.assertEqual(got, want, msg)


def main():
    global TOOL
    if len(sys.argv) < 2:
        print("usage: torch_compat_test.py TORCH_FILE_TOOL [unittest args]", file=sys.stderr)
        return 2
    TOOL = sys.argv[1]
    prog = unittest.main(argv=[sys.argv[0], *sys.argv[2:]], exit=False, verbosity=2)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
