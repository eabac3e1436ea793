"""Parameters and gradients changed under zinf.torch.ZeroOptimizer: each is copied in correctly or
refused on every rank, never a silent wrong update, at ZeRO stage 1 (the registered .grad).
`mpirun -np N python3 changes.py <work dir>`
(N >= 2: the refused changes are made on one rank only). Every rank sets its own synthetic
gradient of each parameter at each step; in one run:

  - replaced: 9 steps in which each parameter's .grad is, in turn, written in place, replaced
    by float64, float16 and bfloat16 tensors (p.grad.data = t), by strided float32 tensors
    (p.grad = t, p.grad.data = t, p.grad.set_(t)), by a new tensor, and (the square weight) by
    a transposed view of its own memory: the weights equal torch.optim.AdamW fed the mean over
    the ranks of the same gradients (rounded as the replacements round them), with the same
    clipping and warmup, within 1e-5 relative;
  - refused, on every rank with the error naming the rank that made the change: a parameter's
    .data replaced by its transpose (same memory, other strides), by a strided view of another
    tensor, by a copy; a .grad of int32, bool, complex64, another shape (p.grad.data = t,
    p.grad.set_(t)), sparse; afterwards the optimizer steps on;
  - client_state: differing on ranks 1.. (rank 1 named) or on the last rank only (it named) is
    refused; the same dict in another key order is saved and loaded back; a failed
    load_checkpoint leaves the optimizer as it was (its step and client_state);
  - staged (bfloat16 parameters, bf16.enabled): float64, float32 and float16 .grad copied in
    (StepInfo.grad_norm of the mean gradient), a transposed .data and an int32 .grad refused,
    zero_grad turning a replaced .grad back into bfloat16 zeros.
"""

import os
import re
import sys

import torch

import common
import zinf
import zinf.torch
from zinf import _zinf

TOLERANCE = 1e-5
SQUARE = "2.weight"  # common.make_model's 32 x 32 weight


def stage1(cfg):
    """The config at ZeRO stage 1, whose .grad is the engine's registered buffer that a program
    may write or replace (stages 2 and 3 lend every gradient from the backward pass: .grad is
    None after it)."""
    cfg["zero_optimization"]["stage"] = 1
    return cfg


def gradient(step, rank, index, shape):
    """Rank `rank`'s gradient of parameter `index` at `step`: every rank can make any rank's.
    Odd steps small (not clipped), even steps large (clipped to 0.5)."""
    g = torch.Generator().manual_seed(100003 * step + 1009 * rank + index)
    return torch.randn(shape, generator=g) * (0.005 if step % 2 else 0.05)


def strided(g):
    """g's values in a non-contiguous float32 tensor of its shape (every other element)."""
    out = torch.zeros(*g.shape, 2)[..., 0]
    out.copy_(g)
    assert not out.is_contiguous()
    return out


def received(g, how):
    """The float32 values the optimizer must get for gradient `g` put in `how`'s way."""
    return g.to(getattr(torch, how)).float() if how in ("float16", "bfloat16") else g


def replace(p, g, how):
    """Puts gradient `g` into p.grad the way `how` says."""
    if how == "in place":
        p.grad.copy_(g)
    elif how == "new tensor":
        p.grad = g.clone()
    elif how in ("float64", "float16", "bfloat16", "float32"):
        p.grad.data = g.to(getattr(torch, how))
    elif how == "strided =":
        p.grad = strided(g)
    elif how == "strided .data":
        p.grad.data = strided(g)
    elif how == "strided set_":
        p.grad.set_(strided(g))
    elif how == "transposed in its own memory":  # the registered memory holds g^T
        p.grad.copy_(g.t())
        p.grad.data = p.grad.data.t()
    else:
        raise AssertionError(how)


WAYS = ["in place", "float64", "float16", "bfloat16", "strided =", "strided .data",
        "strided set_", "new tensor", "transposed in its own memory"]


def agree_ok(what, problem):
    """Every rank's outcome of a sub-case: a failure on any rank fails it on every rank."""
    _zinf.agree("Internal", f"{what}: {problem}" if problem else "", call="agree_ok")


def expect_error(what, cls, pattern, action):
    try:
        action()
        problem = f"nothing raised (expected {cls.__name__} matching {pattern!r})"
    except zinf.ZinfError as e:
        problem = ("" if isinstance(e, cls) and re.search(pattern, str(e))
                   else f"expected {cls.__name__} matching {pattern!r}, got {e!r}")
    agree_ok(what, problem)


def set_gradients(model, step, rank):
    for i, p in enumerate(model.parameters()):
        p.grad.copy_(gradient(step, rank, i, p.shape))


def replaced(model, opt, rank, world):
    ref_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(ref_params, lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    names = [name for name, _ in model.named_parameters()]
    steps = len(WAYS)
    clipped = 0
    for step in range(1, steps + 1):
        seen = [torch.zeros_like(p) for p in ref_params]
        for r in range(world):
            for i, p in enumerate(model.parameters()):
                how = WAYS[(i + step) % len(WAYS)]
                if how.startswith("transposed") and names[i] != SQUARE:
                    how = "in place"
                g = gradient(step, r, i, p.shape)
                seen[i] += received(g, how)
                if r == rank:
                    replace(p, g, how)
        info = opt.step()
        clipped += info.clipped
        for p, g in zip(ref_params, seen):
            p.grad = g / world
        torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
        for group in ref.param_groups:
            group["lr"] = common.warmup_lr(step)
        ref.step()
        agree_ok(f"replaced, step {step}",
                 "" if all(p.grad is not None and not p.grad.any() for p in model.parameters())
                 else "step() left a .grad that is not zero")
    worst = max(float((a.detach() - b.detach()).norm() / b.detach().norm())
                for a, b in zip(model.parameters(), ref_params))
    moved = common.max_relative_error(model, common.make_model())
    zinf.log(f"replaced gradients: {steps} steps ({clipped} clipped) on {world} ranks, max "
             f"relative weight error vs torch.optim.AdamW {worst:.2e}")
    agree_ok("replaced", "" if worst < TOLERANCE and moved > 1e-3 and 0 < clipped < steps else
             f"relative error {worst:.3e}, moved {moved:.3e}, {clipped} of {steps} clipped")


def refused(model, opt, rank, world):
    bad = world - 1  # the rank that makes the change
    weight = dict(model.named_parameters())[SQUARE]
    original = weight.data
    grad_of = model[0].weight  # "0.weight", [32, 16]
    prefix = f"^FailedPrecondition: rank {bad}: "

    def weight_data(make):
        def change():
            weight.data = make()
        return change

    def grad_data(make):
        def change():
            grad_of.grad.data = make(grad_of.grad.data)
        return change

    def grad_set(t):
        def change():
            grad_of.grad.set_(t)
        return change

    def grad_assign(make):
        def change():
            grad_of.grad = make(grad_of.grad)
        return change

    cases = [
        ("transposed .data", weight_data(lambda: original.t()),
         r"parameter 2\.weight: its \.data was replaced by a tensor with strides \(1, 32\) "
         r"instead of \(32, 1\)"),
        ("strided .data", weight_data(lambda: torch.zeros(32, 64)[:, ::2]),
         r"parameter 2\.weight: its \.data was replaced by a tensor in other memory and with "
         r"strides \(64, 2\)"),
        ("copied .data", weight_data(lambda: original.clone()),
         r"parameter 2\.weight: its \.data was replaced by a tensor in other memory;"),
        ("int32 .grad", grad_data(lambda g: g.int()),
         r"parameter 0\.weight: its \.grad is torch\.int32; a replaced \.grad is copied in when"),
        ("bool .grad", grad_data(lambda g: g.bool()),
         r"parameter 0\.weight: its \.grad is torch\.bool;"),
        ("complex .grad", grad_data(lambda g: torch.complex(g, g)),
         r"parameter 0\.weight: its \.grad is torch\.complex64;"),
        ("wrong shape .grad.data", grad_data(lambda g: torch.ones(16, 32)),
         r"parameter 0\.weight: its \.grad has shape \[16, 32\], not \[32, 16\]"),
        ("wrong shape .grad.set_", grad_set(torch.ones(5)),
         r"parameter 0\.weight: its \.grad has shape \[5\], not \[32, 16\]"),
        ("sparse .grad", grad_assign(lambda g: g.to_sparse()),
         r"parameter 0\.weight: its \.grad is a torch\.sparse_coo tensor"),
    ]
    step = opt.global_step
    for what, change, pattern in cases:
        set_gradients(model, step + 1, rank)
        if rank == bad:
            change()
        expect_error(f"refused: {what}", zinf.errors.FailedPreconditionError, prefix + pattern,
                     opt.step)
        weight.data = original
        opt.zero_grad()
    set_gradients(model, step + 1, rank)
    before = weight.detach().clone()
    info = opt.step()
    agree_ok("refused: then a step", "" if info.step == step + 1 and
             not torch.equal(before, weight) else f"{info}")
    zinf.log(f"refused: {len(cases)} changes made on rank {bad} only, raised on every rank")


def client_state(work, opt, rank, world):
    ckpt = os.path.join(work, "ckpt")
    expect_error("client_state differing on ranks 1..", zinf.errors.InvalidArgumentError,
                 r"^InvalidArgument: rank 1: save_checkpoint: client_state differs from rank "
                 r"0's",
                 lambda: opt.save_checkpoint(ckpt, client_state={"epoch": 3, "rank": rank}))
    last = world - 1
    expect_error("client_state differing on the last rank", zinf.errors.InvalidArgumentError,
                 rf"^InvalidArgument: rank {last}: save_checkpoint: client_state differs",
                 lambda: opt.save_checkpoint(ckpt, client_state={"last": rank == last}))
    # The same state, built in another key order on odd ranks.
    items = [("epoch", 3), ("batches", [1, 2.5, None]), ("name", "run")]
    state = dict(reversed(items) if rank % 2 else items)
    path = opt.save_checkpoint(ckpt, client_state=state)
    loaded = opt.load_checkpoint(path)
    agree_ok("client_state in another key order", "" if loaded == dict(items) else f"{loaded}")
    # A failed load leaves the optimizer as it was (it restores through the open engine).
    step = opt.global_step
    expect_error("failed load_checkpoint", zinf.errors.NotFoundError, r"no checkpoint at",
                 lambda: opt.load_checkpoint(os.path.join(work, "missing")))
    agree_ok("after a failed load_checkpoint",
             "" if opt.global_step == step and opt.client_state == dict(items)
             else f"step {opt.global_step}, client_state {opt.client_state}")


def staged(work, rank, world):
    model = common.make_model().to(torch.bfloat16)
    cfg = stage1(common.config(os.path.join(work, "swap.bf16"))) | {"bf16": {"enabled": True}}
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    ways = ["float64", "float32", "float16", "in place"]
    total = 0.0
    for i, p in enumerate(model.parameters()):
        mean = torch.zeros(p.shape)
        for r in range(world):
            g = gradient(1, r, i, p.shape)
            how = ways[i % len(ways)]
            rounded = g.to(p.dtype if how == "in place" else getattr(torch, how)).float()
            mean += rounded / world
            if r == rank:
                replace(p, g.to(p.dtype) if how == "in place" else g, how)
        total += float(mean.double().norm() ** 2)
    expected = total ** 0.5
    info = opt.step()
    ok = (abs(info.grad_norm - expected) <= 1e-5 * expected
          and all(p.dtype == torch.bfloat16 and not p.grad.any() for p in model.parameters()))
    agree_ok("staged: replaced .grad copied in",
             "" if ok else f"grad_norm {info.grad_norm}, expected {expected}")
    bad, weight = world - 1, dict(model.named_parameters())[SQUARE]
    original = weight.data
    if rank == bad:
        weight.data = original.t()
    expect_error("staged: transposed .data", zinf.errors.FailedPreconditionError,
                 rf"^FailedPrecondition: rank {bad}: parameter 2\.weight: its \.data was "
                 r"replaced by a tensor with strides \(1, 32\)", opt.step)
    weight.data = original
    if rank == bad:
        weight.grad.data = weight.grad.data.int()
    expect_error("staged: int32 .grad", zinf.errors.FailedPreconditionError,
                 rf"^FailedPrecondition: rank {bad}: parameter 2\.weight: its \.grad is "
                 r"torch\.int32", opt.step)
    weight.grad.data = torch.ones(32, 32, dtype=torch.float64)
    opt.zero_grad()
    agree_ok("staged: zero_grad", "" if weight.grad.dtype == torch.bfloat16
             and not weight.grad.any() else f"{weight.grad.dtype}")
    opt.close()


def main():
    work = sys.argv[1]
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    common.check(world >= 2, "run on 2 or more ranks")
    model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(),
                                   config=stage1(common.config(os.path.join(work, "swap"))),
                                   progress=False, create_nvme_paths=True)
    replaced(model, opt, rank, world)
    refused(model, opt, rank, world)
    staged(work, rank, world)
    client_state(work, opt, rank, world)
    opt.close()
    zinf.log("changes: OK")


if __name__ == "__main__":
    main()
