"""zinf.torch with fp16 parameters and DeepSpeed's dynamic loss scaling:
`mpirun -np N python3 fp16.py <work dir>` (N >= 2: the overflows are injected on one rank).

A float16 copy of the common model (computed in float32 from its fp16 weights: torch 1.13 has no
fp16 matmul on the CPU) trains STEPS steps through opt.backward(loss). At the steps of OVERFLOWS
one rank puts an Inf into one element of one gradient during the backward pass (a hook on the
parameter: at stage 2, the common config's, each gradient goes to the engine as the pass
completes it). Checks, on every rank:
  - the loss falls; the parameters stay float16; every .grad is None after step() (stage 2);
  - StepInfo.skipped is True exactly at the injected steps, the weights are then unchanged
    (elsewhere they move), skipped_steps counts them, and the schedule does not advance;
  - opt.loss_scale before each step, StepInfo.loss_scale and next_loss_scale follow a reference
    of DeepSpeed's DynamicLossScaler (hysteresis, window, consecutive_hysteresis);
  - the fp32 master weights of a checkpoint (zinf-ckpt export) start as the fp16 values and
    round to the parameters' fp16 weights; a fresh optimizer that loads the checkpoint has its
    step, loss scale and skipped steps, and continues bitwise like the run that saved it.
A second run with consecutive_hysteresis checks the scale sequence only, a third the same with
float32 parameters (used in place; their weights rounded to fp16 values), and a short run of
bfloat16 parameters with bf16.enabled checks that they train and stay bfloat16."""

import json
import os
import struct
import subprocess
import sys

import torch

import common
import zinf.torch

STEPS = 30
SAVE_AT = 18
# Overflows: single ones (hysteresis 2 absorbs the first), two and three in a row.
OVERFLOWS = {4, 9, 10, 15, 21, 22, 23}
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 4,
        "hysteresis": 2, "min_loss_scale": 1}


class Reference:
    """DeepSpeed's DynamicLossScaler.update_scale (scale factor 2)."""

    def __init__(self, fp16):
        self.scale = 2.0 ** fp16["initial_scale_power"]
        self.window = fp16["loss_scale_window"]
        self.delayed_shift = fp16["hysteresis"]
        self.hysteresis = self.delayed_shift
        self.consecutive = fp16.get("consecutive_hysteresis", False)
        self.min_scale = fp16["min_loss_scale"]
        self.iteration = 0
        self.last_overflow = -1
        self.halved = self.doubled = 0

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
                self.halved += 1
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.hysteresis = self.delayed_shift
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self.hysteresis = self.delayed_shift
                self.scale *= 2
                self.doubled += 1
        self.iteration += 1


class HalfModel(torch.nn.Module):
    """common.make_model's layers in float16 (or `dtype`), computed in float32."""

    def __init__(self, seed=0, dtype=torch.float16):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            m for m in common.make_model(seed) if isinstance(m, torch.nn.Linear)).to(dtype)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.nn.functional.linear(x, layer.weight.float(), layer.bias.float())
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


TARGET = torch.randn(16, 4, generator=torch.Generator().manual_seed(7)) * 0.3


def batch(step):
    """common.batch's inputs with a learnable target (its own targets are noise)."""
    x, _ = common.batch(step)
    return x, torch.tanh(x @ TARGET)


def weights(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file (the format is a JSON header and raw data)."""
    with open(path, "rb") as f:
        data = f.read()
    (header_bytes,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_bytes])
    base = 8 + header_bytes
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        common.check(meta["dtype"] == "F32", f"export {name}: dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[base + begin:base + end]),
                                     dtype=torch.float32).reshape(meta["shape"])
    return out


def export_master(ckpt, out):
    """Rank 0 exports the checkpoint's fp32 master weights (zinf-ckpt export; --force replaces
    the output of an earlier run of this test in the same work directory)."""
    subprocess.run([os.environ["TEST_ZINF_CKPT"], "export", ckpt, "--out", out, "--format",
                    "safetensors", "--force"], check=True, stdout=subprocess.DEVNULL)
    return read_safetensors(out)


def train(model, opt, first, last, ref, saved=None, dtype=torch.float16):
    """Steps first..last; checks every step against `ref` (advanced here). Returns the losses."""
    rank, world = opt.rank, opt.world_size
    losses = []
    for step in range(first, last + 1):
        common.check(opt.loss_scale == ref.scale,
                     f"step {step}: opt.loss_scale {opt.loss_scale} != reference {ref.scale}")
        x, y = batch(step)
        loss = common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world))
        if step == first:
            scaled = opt.scale_loss(loss)
            common.check(scaled.dtype == torch.float32 and
                         float(scaled) == float(loss.float()) * ref.scale, "scale_loss")
        overflow = step in OVERFLOWS
        hook = None
        if overflow and rank == step % world:
            def poison(grad):
                grad = grad.clone()
                grad[3, 5] = float("inf")
                return grad
            hook = model.layers[1].weight.register_hook(poison)
        opt.backward(loss)
        if hook is not None:
            hook.remove()
        before = weights(model)
        skipped_before = opt.skipped_steps
        info = opt.step(loss=loss)
        scale = ref.scale
        ref.update(overflow)
        common.check(info.step == step, f"StepInfo.step {info.step} != {step}")
        common.check(info.skipped == overflow,
                     f"step {step}: skipped {info.skipped}, injected overflow {overflow}")
        common.check(info.loss_scale == scale, f"step {step}: loss_scale {info.loss_scale} != "
                     f"{scale}")
        common.check(info.next_loss_scale == ref.scale,
                     f"step {step}: next_loss_scale {info.next_loss_scale} != {ref.scale}")
        common.check(info.skipped_steps == skipped_before + overflow == opt.skipped_steps,
                     f"step {step}: skipped_steps {info.skipped_steps}")
        after = weights(model)
        same = all(torch.equal(before[k], after[k]) for k in after)
        if overflow:
            common.check(same, f"step {step}: a skipped step changed the weights")
            common.check(not torch.isfinite(torch.tensor(info.grad_norm)),
                         f"step {step}: grad_norm {info.grad_norm} of a skipped step")
        else:
            common.check(not same or info.lr == 0, f"step {step}: the weights did not move")
            applied = step - info.skipped_steps
            common.check(abs(info.lr - common.warmup_lr(applied)) < 1e-12,
                         f"step {step}: lr {info.lr}, the schedule's {common.warmup_lr(applied)} "
                         f"at applied step {applied}")
            losses.append(info.loss)
        for name, p in model.named_parameters():
            common.check(p.dtype == dtype, f"{name} is {p.dtype} after step {step}")
            common.check(torch.equal(p, p.half().to(dtype)),
                         f"{name}: working weights not rounded to fp16 after step {step}")
            common.check(p.grad is None, f"{name}: .grad {p.grad} after step {step} (stage 2 "
                         "lends every gradient)")
        if saved is not None and step == SAVE_AT:
            saved(opt, model)
    return losses


def config(work, fp16):
    return common.config(os.path.join(work, "swap"), fp16=fp16)


def main():
    work = sys.argv[1]
    facts = zinf.init()
    rank = facts["rank"]
    common.check(facts["world_size"] >= 2, "fp16.py injects overflows on one rank of several")
    ckpt = os.path.join(work, "ckpt")

    # The run that saves at SAVE_AT.
    model = HalfModel()
    initial = weights(model)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config(work, FP16),
                                   progress=False, create_nvme_paths=True)
    ref = Reference(FP16)
    common.check(opt.loss_scale == ref.scale == 256.0, f"first loss_scale {opt.loss_scale}")
    master0 = None
    path0 = opt.save_checkpoint(os.path.join(work, "ckpt0"))  # step 0: the initial master
    if rank == 0:
        master0 = export_master(path0, os.path.join(work, "master0.safetensors"))
        for name, w in initial.items():
            common.check(torch.equal(master0[name], w.float()),
                         f"{name}: the initial fp32 master is not the fp16 weights")
    at_save = {}

    def saved(o, m):
        at_save["path"] = o.save_checkpoint(ckpt)
        at_save["weights"] = weights(m)
        at_save["scale"] = o.loss_scale
        at_save["skipped"] = o.skipped_steps

    losses = train(model, opt, 1, STEPS, ref, saved)
    final = weights(model)
    opt.close()
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    common.check(last < 0.8 * first, f"the loss did not fall: {first:.4f} -> {last:.4f}")
    common.check(ref.halved >= 2 and ref.doubled >= 1,
                 f"the scale halved {ref.halved} and doubled {ref.doubled} times")
    scales = f"halved {ref.halved}x, doubled {ref.doubled}x"
    if rank == 0:
        master = export_master(at_save["path"], os.path.join(work, "master.safetensors"))
        for name, w in at_save["weights"].items():
            common.check(torch.equal(master[name].half(), w),
                         f"{name}: the fp16 weights are not the fp32 master rounded")
        common.check(any(not torch.equal(master[k], master[k].half().float()) for k in master),
                     "the fp32 master holds only fp16 values: no fp32 master")

    # A fresh optimizer loads the checkpoint and continues bitwise.
    model = HalfModel(seed=123)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config(work, FP16),
                                   progress=False, create_nvme_paths=True)
    opt.load_checkpoint(ckpt)
    common.check(opt.global_step == SAVE_AT, f"global_step {opt.global_step}")
    common.check(opt.loss_scale == at_save["scale"],
                 f"loss_scale {opt.loss_scale} after the load, {at_save['scale']} saved")
    common.check(opt.skipped_steps == at_save["skipped"],
                 f"skipped_steps {opt.skipped_steps} after the load, {at_save['skipped']} saved")
    for name, w in weights(model).items():
        common.check(torch.equal(w, at_save["weights"][name]), f"{name} differs after the load")
    ref = Reference(FP16)
    for step in range(1, SAVE_AT + 1):
        ref.update(step in OVERFLOWS)
    train(model, opt, SAVE_AT + 1, STEPS, ref)
    for name, w in weights(model).items():
        common.check(torch.equal(w, final[name]), f"{name}: the resumed run differs")
    opt.close()

    # consecutive_hysteresis: a clean step refills the hysteresis.
    fp16 = dict(FP16, consecutive_hysteresis=True, hysteresis=3, loss_scale_window=3)
    model = HalfModel()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config(work, fp16),
                                   progress=False, create_nvme_paths=True)
    train(model, opt, 1, STEPS, Reference(fp16))
    opt.close()

    # float32 parameters with fp16.enabled: used in place, the engine rounds the weights it
    # writes to fp16 values.
    model = HalfModel(dtype=torch.float32)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config(work, FP16),
                                   progress=False, create_nvme_paths=True)
    train(model, opt, 1, 12, Reference(FP16), dtype=torch.float32)
    opt.close()

    # bfloat16 parameters with bf16.enabled (no loss scaling): staged like fp16 ones.
    model = HalfModel(dtype=torch.bfloat16)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(),
                                   config=config(work, {"enabled": False}) | {
                                       "bf16": {"enabled": True}},
                                   progress=False, create_nvme_paths=True)
    for step in range(1, 6):
        x, y = batch(step)
        before = weights(model)
        opt.backward(common.loss_fn(model, common.shard(x, rank, opt.world_size),
                                    common.shard(y, rank, opt.world_size)))
        info = opt.step()
        common.check(opt.loss_scale == 1.0 and info.loss_scale == 1.0 and not info.skipped,
                     f"bf16 step {step}: {info}")
        for name, p in model.named_parameters():
            common.check(p.dtype == torch.bfloat16 and p.grad is None, f"bf16 {name}")
        common.check(info.lr == 0 or any(not torch.equal(before[k], p)
                                         for k, p in model.named_parameters()),
                     f"bf16 step {step}: the weights did not move")
    opt.close()
    zinf.log(f"fp16: {STEPS} steps on {facts['world_size']} ranks, {len(OVERFLOWS)} overflows "
             f"skipped, loss {first:.4f} -> {last:.4f}, loss scale {scales}; resumed bitwise")


if __name__ == "__main__":
    main()
