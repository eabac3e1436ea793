"""Python's side of pickle_test (PythonPickles.*), run by the test itself.

  make_pickles.py gen DIR    writes DIR/<case>.pkl, made by Python's pickle and by torch.save
                             (data.pkl taken out of the zip), with DIR/<case>.canon (the value in
                             the canonical text the C++ test prints) or DIR/<case>.error (a
                             substring of the error zinf must give), and DIR/cases.txt.
  make_pickles.py check DIR  reads DIR/out/<case>.pkl, which zinf's WritePickle wrote, and
                             DIR/out/<case>.canon (the C++ value): Python's own unpickler must
                             give the same value, and torch.load must load the pickle put in a
                             zip with its storages (values checked against those storages).

Exit 77 when torch cannot be imported (the C++ test then skips). The canonical text:
None True False 12 f:<16 hex digits of the double> 'str' [a, b] (a, b) Size(a, b) {k: v}
OrderedDict{k: v} dtype(float16) tensor(dtype, 'key', 'location', numel, offset, [shape],
[stride], requires_grad) module.Class(<state>). DeepSpeed's classes are stand-ins registered
under DeepSpeed's module names (fake_deepspeed.py), so neither side needs DeepSpeed.
"""
import collections
import enum
import io
import os
import pickle
import re
import struct
import sys
import types
import zipfile

try:
    import torch
except Exception as e:  # noqa: BLE001
    print(f"SKIP: torch cannot be imported: {e}")
    sys.exit(77)

import fake_deepspeed  # noqa: E402 - after the torch check: it imports torch
from fake_deepspeed import (  # noqa: E402
    DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address)

fake_deepspeed.register()


def _obj(cls, **state):
    """An instance holding exactly `state`, made as unpickling makes it (no __init__)."""
    o = cls.__new__(cls)
    o.__dict__.update(state)
    return o


# ---- canonical text


def _str(s):
    b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else bytes(s)
    return "'" + "".join(chr(c) if 0x20 <= c < 0x7F and c not in b"\\'" else "\\x%02x" % c
                         for c in b) + "'"


class StubTensor:
    """What the stand-in unpickler makes of _rebuild_tensor_v2 and _rebuild_parameter."""

    def __init__(self, storage, offset, size, stride, requires_grad):
        self.storage, self.offset = storage, offset
        self.size, self.stride, self.requires_grad = tuple(size), tuple(stride), requires_grad


class StubStorage:
    def __init__(self, dtype, key, location, numel):
        self.dtype, self.key, self.location, self.numel = dtype, key, location, numel


class StubSize(tuple):
    pass


class StubDtype:
    def __init__(self, name):
        self.name = name


def canon(v, masked=False):
    c = lambda x: canon(x, masked)  # noqa: E731
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, enum.Enum):
        return str(int(v.value))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "f:%016x" % struct.unpack("<Q", struct.pack("<d", v))[0]
    if isinstance(v, (str, bytes)):
        return _str(v)
    if isinstance(v, (StubSize, torch.Size)):
        return "Size(" + ", ".join(c(x) for x in v) + ")"
    if isinstance(v, tuple):
        return "(" + ", ".join(c(x) for x in v) + ")"
    if isinstance(v, (list, set, frozenset)):
        return "[" + ", ".join(c(x) for x in v) + "]"
    if isinstance(v, dict):
        head = "OrderedDict{" if isinstance(v, collections.OrderedDict) else "{"
        return head + ", ".join(c(k) + ": " + c(x) for k, x in v.items()) + "}"
    if isinstance(v, StubDtype):
        return f"dtype({v.name})"
    if isinstance(v, torch.dtype):
        return f"dtype({str(v).removeprefix('torch.')})"
    if isinstance(v, StubTensor):
        s = v.storage
        where = "*, *, *" if masked else f"{_str(s.key)}, {_str(s.location)}, {s.numel}"
        return (f"tensor({s.dtype}, {where}, {v.offset}, [{', '.join(map(str, v.size))}], "
                f"[{', '.join(map(str, v.stride))}], {v.requires_grad})")
    if isinstance(v, torch.Tensor):  # as torch.load made it: the key is gone
        assert masked
        dtype = str(v.dtype).removeprefix("torch.")
        return (f"tensor({dtype}, *, *, *, {v.storage_offset()}, "
                f"[{', '.join(map(str, v.shape))}], [{', '.join(map(str, v.stride()))}], "
                f"{v.requires_grad})")
    if type(v) in (fragment_address, LossScaler, DynamicLossScaler):
        return f"{type(v).__module__}.{type(v).__qualname__}({c(v.__dict__)})"
    raise TypeError(f"no canonical text for {type(v)}")


_STORAGE_DTYPES = {
    "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


class StubUnpickler(pickle.Unpickler):
    """Python's own unpickler with torch's globals replaced by inert stand-ins."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda st, off, size, stride, rg, hooks, *meta: StubTensor(
                st, off, size, stride, rg)
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            def param(t, rg, hooks):
                t.requires_grad = rg
                return t
            return param
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name == "Size":
            return StubSize
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return StubDtype(name)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        tag, dtype, key, location, numel = pid
        assert tag == "storage"
        return StubStorage(dtype, key, location, numel)


def stub_load(data):
    return StubUnpickler(io.BytesIO(data)).load()


# ---- gen


def plain_cases():
    nested = {"a": [1, 2, (3, 4.5)], "b": {"c": None, "d": [True, False]}}
    od = collections.OrderedDict([("z", 1), ("a", [1, 2]), ("m", {"x": -1})])
    shared = [7, 8]
    yield "scalars", {
        "none": None, "t": True, "f": False, "zero": 0, "i1": 255, "i2": 65535, "i4": -1,
        "i32": 2**31 - 1, "n32": -(2**31), "big": 2**40 + 5, "nbig": -(2**62), "max": 2**63 - 1,
        "min": -(2**63), "pi": 3.141592653589793, "neg": -0.0, "tiny": 5e-324,
        "inf": float("inf"), "s": "h\u00e9llo \u2603 \U0001F600", "empty": "",
    }
    yield "containers", {
        "nested": nested, "od": od, "t0": (), "t1": (1,), "t2": (1, 2), "t3": (1, 2, 3),
        "t5": (1, 2, 3, 4, 5), "long": list(range(2500)), "set": {3, 1, 2},
        "fs": frozenset({"x"}), 7: "int key", (1, "a"): "tuple key", "shared": [shared, shared],
    }
    yield "objects", {
        "frag": _obj(fragment_address, numel=10, start=4),
        "scaler": _obj(DynamicLossScaler, cur_scale=65536.0, cur_iter=3, dtype=torch.float16,
                       scale_window=1000, dynamic=True),
        "static": _obj(LossScaler, cur_scale=1.0, dynamic=False),
        "stage": ZeroStageEnum.gradients,
    }


def torch_cases():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    yield "torch_tensors", {
        "t": t, "row": t[1], "col": t[:, 2], "view": t[1:, 1:3],
        "half": torch.ones(5, dtype=torch.float16), "bf16": torch.zeros(2, 2, dtype=torch.bfloat16),
        "f64": torch.ones(1, dtype=torch.float64), "step": torch.tensor(17),
        "i32": torch.ones(3, dtype=torch.int32), "u8": torch.ones(3, dtype=torch.uint8),
        "bool": torch.ones(2, dtype=torch.bool), "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
    }
    yield "torch_state", {
        "module": collections.OrderedDict([("w", torch.ones(2, 3)), ("b", torch.zeros(3))]),
        "param_shapes": [collections.OrderedDict([("w", torch.Size([2, 3])),
                                                  ("b", torch.Size([3]))])],
        "param_slice_mappings": [collections.OrderedDict(
            [("w", _obj(fragment_address, numel=6, start=0))])],
        "dtype": torch.bfloat16, "ds_version": "0.19.6", "zero_stage": ZeroStageEnum.gradients,
        "sparse_tensor_module_names": set(), "lr": 1e-3, "betas": (0.9, 0.999),
        "loss_scaler": _obj(DynamicLossScaler, cur_scale=2.0**16, dtype=torch.float16),
    }


def torch_data_pkl(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
    return z.read(name)


def gen(out):
    names = []

    def put(name, data, canon_text=None, error=None):
        with open(os.path.join(out, name + ".pkl"), "wb") as f:
            f.write(data)
        with open(os.path.join(out, name + (".canon" if error is None else ".error")), "w") as f:
            f.write(canon_text if error is None else error)
        names.append(name)

    for name, obj in plain_cases():
        for protocol in range(1, pickle.HIGHEST_PROTOCOL + 1):
            put(f"{name}_p{protocol}", pickle.dumps(obj, protocol=protocol), canon(obj))
    # Protocols 1 and 2 write bytes as _codecs.encode(...), which zinf refuses.
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):
        obj = {"short": b"\x00\xffab", "long": b"x" * 300}
        put(f"bytes_p{protocol}", pickle.dumps(obj, protocol=protocol), canon(obj))
    # Protocol 0 writes str as UNICODE text, which zinf does not read: numbers only here.
    numbers = {1: [1, -2, 2**40, 2.5, None, True], 2: (3, {4: 5.0})}
    put("numbers_p0", pickle.dumps(numbers, protocol=0), canon(numbers))
    for name, obj in torch_cases():
        data = torch_data_pkl(obj)
        put(name, data, canon(stub_load(data)))
    put("beyond_64_bits", pickle.dumps({"x": 2**64}, protocol=2), error="beyond 64 bits")
    put("namespace", pickle.dumps(types.SimpleNamespace(a=1), protocol=2),
        error="pickle names types.SimpleNamespace, which zinf does not load")
    marker = os.path.join(out, "MARKER_os_system_ran")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    for protocol in (2, 4):
        put(f"os_system_p{protocol}", pickle.dumps(Evil(), protocol=protocol),
            error="pickle names posix.system, which zinf does not load (no code is run)")
    with open(os.path.join(out, "cases.txt"), "w") as f:
        f.write("\n".join(names) + "\n")


# ---- check


def check(out):
    failures = 0
    names = sorted(n[:-4] for n in os.listdir(out) if n.endswith(".pkl"))
    assert names, f"nothing in {out}"
    for name in names:
        with open(os.path.join(out, name + ".pkl"), "rb") as f:
            data = f.read()
        with open(os.path.join(out, name + ".canon")) as f:
            want = f.read()
        got = canon(stub_load(data))
        if got != want:
            print(f"FAIL {name}: Python's unpickler reads\n  {got}\nzinf wrote\n  {want}")
            failures += 1
            continue
        # torch.load of the pickle in a zip with its storages, each filled with 0, 1, 2, ...
        storages = {}

        def walk(v):
            if isinstance(v, StubTensor):
                storages[v.storage.key] = v.storage
            elif isinstance(v, dict):
                for k, x in v.items():
                    walk(k), walk(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)
            elif hasattr(v, "__dict__") and not isinstance(v, (StubStorage, StubDtype)):
                walk(v.__dict__)
        walk(stub_load(data))
        path = os.path.join(out, name + ".pt")
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", data)
            for key, s in storages.items():
                fill = torch.arange(s.numel).to(getattr(torch, s.dtype))
                z.writestr(f"archive/data/{key}", fill.numpy().tobytes()
                           if s.dtype != "bfloat16" else fill.view(torch.int16).numpy().tobytes())
            z.writestr("archive/version", "3\n")
        loaded = torch.load(path, map_location="cpu")
        masked_want = re.sub(r"tensor\((\w+), '[^']*', '[^']*', \d+,", r"tensor(\1, *, *, *,",
                             want)
        got_torch = canon(loaded, masked=True)
        if got_torch != masked_want:
            print(f"FAIL {name}: torch.load reads\n  {got_torch}\nzinf wrote\n  {masked_want}")
            failures += 1
            continue

        def values(stub, real):
            if isinstance(stub, StubTensor):
                s = stub.storage
                whole = torch.arange(s.numel).to(getattr(torch, s.dtype))
                expect = whole.as_strided(stub.size, stub.stride, stub.offset)
                assert torch.equal(real.detach(), expect), f"{name}: tensor values differ"
            elif isinstance(stub, dict):
                for (k, x), y in zip(stub.items(), real.values()):
                    values(x, y)
            elif isinstance(stub, (list, tuple)):
                for x, y in zip(stub, real):
                    values(x, y)
        values(stub_load(data), loaded)
        print(f"ok {name}")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("gen", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "gen":
        gen(sys.argv[2])
        sys.exit(0)
    sys.exit(check(sys.argv[2]))
