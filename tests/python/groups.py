"""zinf.torch as a torch.optim drop-in: param groups with their own lr and weight_decay, driven
by torch's lr schedulers, with gradient accumulation (k backward passes, then step: torch's way,
each loss divided by k and the config's gradient_accumulation_steps 1, at stage 1, or
DeepSpeed's, the config's gradient_accumulation_steps k, at stage 2), clipping and
step(closure), against torch.optim.AdamW with the same groups and scheduler.

  mpirun -np N python3 groups.py exact <work dir>   LambdaLR, CosineAnnealingLR, OneCycleLR
                                                    (cycles betas), ReduceLROnPlateau, and the
                                                    config's WarmupLR warming each group up to
                                                    its own lr: 1e-5 of torch after 12 steps
  mpirun -np N python3 groups.py save <work dir>    6 steps, a checkpoint with the scheduler's
                                                    state as client_state
  mpirun -np M python3 groups.py resume <work dir>  its restore on M ranks goes on exactly; other
                                                    groups are refused, naming the parameter
  mpirun -np N python3 groups.py bad <work dir>     bad groups and values raise on every rank
"""

import json
import math
import os
import sys

import torch

import common
import zinf
import zinf.errors
import zinf.torch

STEPS = 12
SAVE_AT = 6
GAS = 2  # micro-batches per step and rank
CLIP = 0.5
LR = 0.02
SPLIT = 3  # the first SPLIT parameters (in model order) are group 0, the rest group 1


def groups_of(model, named, split=SPLIT):
    """Two groups, as a fine-tuning recipe has them: one with weight decay, one without and
    with its own lr."""
    params = list(model.named_parameters())
    if not named:
        params = [p for _, p in params]
    return [{"params": params[:split], "weight_decay": 0.1},
            {"params": params[split:], "weight_decay": 0.0, "lr": LR / 2}]


def config(work, world, scheduler=None, gas=GAS):
    cfg = common.config(os.path.join(work, "swap"), lr=LR, clip=CLIP, micro=common.BATCH // gas,
                        world=world, gradient_accumulation_steps=gas)
    del cfg["scheduler"]
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    cfg["zinf"] = {"checkpoint": {"dir": os.path.join(work, "ckpt")}}
    return cfg


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS,
                                                                     eta_min=1e-4),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.03, 0.015],
                                                                total_steps=STEPS),
    "plateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5,
                                                                      patience=0,
                                                                      threshold=0.05),
    # DeepSpeed's WarmupLR without warmup_max_lr (the config's scheduler, not torch's): each
    # group warms up linearly to its own lr over 4 steps, from step 2 on.
    "config_warmup": None,
}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_num_steps": 4,
                                         "warmup_type": "linear"}}


def warmup_factor(step):
    i = max(step - 2, 0)
    return i / 4 if i < 4 else 1.0


def reference(name, steps):
    model = common.make_model()
    opt = torch.optim.AdamW(groups_of(model, named=False), lr=LR, betas=(0.9, 0.99), eps=1e-8)
    sched = SCHEDULERS[name](opt) if SCHEDULERS[name] else None
    base = [g["lr"] for g in opt.param_groups]
    for step in range(1, steps + 1):
        x, y = common.batch(step)
        loss = common.loss_fn(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if sched is None:
            for group, lr in zip(opt.param_groups, base):
                group["lr"] = lr * warmup_factor(step)
        opt.step()
        opt.zero_grad()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(loss.item())
        elif sched is not None:
            sched.step()
    return model


def micro_batches(step, rank, world):
    x, y = common.batch(step)
    x, y = common.shard(x, rank, world), common.shard(y, rank, world)
    n = x.shape[0] // GAS
    return [(x[k * n:(k + 1) * n], y[k * n:(k + 1) * n]) for k in range(GAS)]


def train(model, opt, sched, first, last, use_closure, torch_style=False):
    """Steps first..last as a torch loop: GAS backward passes (of loss / GAS, torch's way, with
    torch_style), then step; the closure form returns the loss the way torch.optim does."""
    for step in range(first, last + 1):
        def closure():
            total = 0.0
            for x, y in micro_batches(step, opt.rank, opt.world_size):
                loss = common.loss_fn(model, x, y)
                (loss / GAS if torch_style else loss).backward()
                total += loss.item()
            if not torch_style:  # handed as the pass completed them (stage 2)
                common.check(all(p.grad is None for p in model.parameters()),
                             "stage 2: .grad is None after the backward pass")
            return total / GAS

        if use_closure:
            loss = opt.step(closure)
            common.check(isinstance(loss, float), f"step(closure) returned {loss!r}")
        else:
            loss = closure()
            info = opt.step(loss=loss)
            common.check(info is opt.last_step_info, "step() returns last_step_info")
        opt.zero_grad(set_to_none=True)
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(opt.last_step_info.loss)  # the mean over ranks: the whole batch's loss
        elif sched is not None:
            sched.step()


def exact(work):
    facts = zinf.init()
    world = facts["world_size"]
    for i, name in enumerate(SCHEDULERS):
        model = common.make_model()
        torch_style = i % 2 == 0  # the config's gradient_accumulation_steps 1, losses / GAS
        cfg = config(os.path.join(work, name), world, WARMUP if name == "config_warmup" else None,
                     gas=1 if torch_style else GAS)
        if torch_style:
            # Passes summed in .grad, then one step: stage 1's registered gradients (stages 2
            # and 3 hand each pass's gradients as it completes them: a pass is a micro-batch).
            cfg["zero_optimization"]["stage"] = 1
        os.makedirs(os.path.join(work, name, "swap"), exist_ok=True)
        # DeepSpeed's accumulation at stage 2: each backward pass hands its gradients from the
        # AccumulateGrad hooks (the second pass of a step the next micro-batch).
        opt = zinf.torch.ZeroOptimizer(groups_of(model, named=True), config=cfg, progress=False)
        common.check([len(g["params"]) for g in opt.param_groups] == [SPLIT, 6 - SPLIT],
                      f"param_groups {[len(g['params']) for g in opt.param_groups]}")
        sched = SCHEDULERS[name](opt) if SCHEDULERS[name] else None
        train(model, opt, sched, 1, STEPS, use_closure=i % 2 == 1, torch_style=torch_style)
        if name == "config_warmup":
            lrs = [g["lr"] for g in opt.param_groups]
            common.check(lrs == [LR, LR / 2], f"WarmupLR's groups end at their own lr: {lrs}")
        if name == "onecycle":
            betas = opt.param_groups[0]["betas"]
            common.check(betas[0] != 0.9, f"OneCycleLR cycled beta1: {betas}")
        opt.close()
        err = common.max_relative_error(model, reference(name, STEPS))
        if facts["rank"] == 0:
            print(f"{name}: max relative error {err:.2e} on {world} rank(s)", flush=True)
        common.check(err < 1e-5, f"{name}: max relative error {err} against torch AdamW")


def save(work):
    world = zinf.init()["world_size"]
    model = common.make_model()
    os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    opt = zinf.torch.ZeroOptimizer(groups_of(model, named=True), config=config(work, world),
                                   progress=False)
    sched = SCHEDULERS["lambda"](opt)
    train(model, opt, sched, 1, SAVE_AT, use_closure=False)
    opt.save_checkpoint(client_state={"sched": sched.state_dict()})
    if opt.rank == 0:
        with open(os.path.join(work, "state_dict.json"), "w") as f:
            json.dump(opt.state_dict(), f)
    opt.close()


def resume(work):
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    cfg = config(work, world)
    with open(os.path.join(work, "state_dict.json")) as f:
        saved = json.load(f)
    corrupt = os.path.join(work, "truncated.h5")
    if rank == 0:  # the checkpoint cut in half (the optimizers' creation below is collective)
        with open(saved["zinf"]["checkpoint"], "rb") as f:
            data = f.read()
        with open(corrupt, "wb") as f:
            f.write(data[:len(data) // 2])
    # Other groups (the 4th parameter moved into group 0: the same order, other groups): refused
    # at creation and by a live optimizer's load, naming the parameter.
    model = common.make_model(seed=1)
    moved = "parameter '2.bias' is in parameter group 1 of the checkpoint but in group 0"
    expect(zinf.errors.FailedPreconditionError, moved, lambda: zinf.torch.ZeroOptimizer(
        groups_of(model, named=True, split=SPLIT + 1), config=cfg,
        load=os.path.join(work, "ckpt"), progress=False))
    other = zinf.torch.ZeroOptimizer(groups_of(model, named=True, split=SPLIT + 1), config=cfg,
                                     progress=False)
    expect(zinf.errors.FailedPreconditionError, moved,
           lambda: other.load_checkpoint(os.path.join(work, "ckpt")))
    other.close()
    # The same groups, through the open engine: a missing and a truncated file are refused and
    # leave the optimizer as it was; the state_dict saved then restores it, and the run goes on
    # exactly (weights from the checkpoint, not seed 1).
    opt = zinf.torch.ZeroOptimizer(groups_of(model, named=True), config=cfg, progress=False)
    sched = SCHEDULERS["lambda"](opt)
    before = [p.detach().clone() for p in model.parameters()]
    expect(zinf.errors.NotFoundError, "", lambda: opt.load_checkpoint(os.path.join(work, "none")))
    expect(zinf.errors.ZinfError, "truncated.h5", lambda: opt.load_checkpoint(corrupt))
    common.check(opt.global_step == 0 and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters())), "a failed load changed it")
    opt.load_state_dict(saved)
    sched.load_state_dict(opt.client_state["sched"])
    common.check(opt.global_step == SAVE_AT, f"restored step {opt.global_step}")
    common.check(opt.param_groups[1]["lr"] == LR / 2 * min(1.0, (SAVE_AT + 1) / 4),
                 f"the restored group lr is the scheduler's for step {SAVE_AT + 1}: "
                 f"{opt.param_groups[1]['lr']}")
    train(model, opt, sched, SAVE_AT + 1, STEPS, use_closure=True)
    opt.close()
    err = common.max_relative_error(model, reference("lambda", STEPS))
    if rank == 0:
        print(f"resumed on {world} rank(s): max relative error {err:.2e}", flush=True)
    common.check(err < 1e-5, f"resumed: max relative error {err}")


def expect(error_class, text, action):
    try:
        action()
    except error_class as e:
        common.check(text in str(e), f"{error_class.__name__} without '{text}': {e}")
        return
    common.check(False, f"no {error_class.__name__} ('{text}')")


def bad(work):
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    cfg = config(work, world)
    os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    model = common.make_model()
    params = list(model.parameters())

    def create(groups, config_=cfg):
        return zinf.torch.ZeroOptimizer(groups, config=config_, progress=False)

    expect(zinf.errors.InvalidArgumentError, "unknown key(s) ['momentum']",
           lambda: create([{"params": params, "momentum": 0.9}]))
    expect(zinf.errors.InvalidArgumentError, "is in param groups 0 and 1",
           lambda: create([{"params": params[:3]}, {"params": params[2:]}]))
    expect(zinf.errors.InvalidArgumentError, "'lr' is -1.0",
           lambda: create([{"params": params, "lr": -1.0}]))

    opt = create(groups_of(model, named=True))
    expect(ValueError, "add_param_group", lambda: opt.add_param_group({"params": []}))
    opt.close()
    # overlap_backward: zero_grad() after a finished pass drops its gradients (handed.py checks
    # the weights), so the next pass is the step's only micro-batch.
    opt = zinf.torch.ZeroOptimizer(groups_of(model, named=True), config=config(work, world, gas=1),
                                   progress=False, overlap_backward=True)
    x, y = micro_batches(1, rank, world)[0]
    common.loss_fn(model, x, y).backward()
    opt.zero_grad()
    common.loss_fn(model, x, y).backward()
    opt.step()
    opt.close()
    opt = create(groups_of(model, named=True))
    # A scheduler that writes NaN at its third step: refused on every rank, nothing stepped.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.nan if s >= 2 else 1.0)
    for step in range(1, 4):
        for x, y in micro_batches(step, rank, world):
            common.loss_fn(model, x, y).backward()
        if step < 3:
            opt.step()
            opt.zero_grad()
            sched.step()
    before = [p.detach().clone() for p in params]
    expect(zinf.errors.FailedPreconditionError, "param_groups[0]: 'lr' is nan", opt.step)
    common.check(all(torch.equal(a, b) for a, b in zip(before, params)), "nothing stepped")
    # An lr that differs on one rank.
    if world > 1:
        for group in opt.param_groups:
            group["lr"] = 0.01 if rank == world - 1 else 0.02
        expect(zinf.errors.FailedPreconditionError, "differ from rank 0's", opt.step)
        common.check(all(torch.equal(a, b) for a, b in zip(before, params)), "nothing stepped")
    for group in opt.param_groups:
        group["lr"] = 0.01
    opt.step()  # the same gradient, now with a good lr
    opt.close()

    # Under the config's scheduler the lr is not the program's to write.
    opt = create(groups_of(model, named=True), config(work, world, WARMUP))
    for x, y in micro_batches(1, rank, world):
        common.loss_fn(model, x, y).backward()
    opt.param_groups[0]["lr"] = 0.5
    expect(zinf.errors.FailedPreconditionError, "config's scheduler block", opt.step)
    opt.close()
    if rank == 0:
        print("bad inputs: raised on every rank", flush=True)


if __name__ == "__main__":
    {"exact": exact, "save": save, "resume": resume, "bad": bad}[sys.argv[1]](sys.argv[2])
