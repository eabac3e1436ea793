"""Shared by the zinf.torch tests: a small model, its batches, configs and a reference run."""

import math
import os
import sys

import torch

HIDDEN = 32
BATCH = 12  # divides among 1, 2, 3 and 4 ranks


def make_model(seed=0, hidden=HIDDEN):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 4))


def batch(step, size=BATCH):
    """The global batch of step `step` (1-based): the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 16, generator=g)
    y = torch.randn(size, 4, generator=g)
    return x, y


def shard(tensor, rank, world):
    n = tensor.shape[0] // world
    return tensor[rank * n:(rank + 1) * n]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def config(swap, optimizer="AdamW", adam_w_mode=None, lr=0.02, warmup=5, clip=0.5,
           micro=BATCH, world=1, **extra):
    params = {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05}
    if adam_w_mode is not None:
        params["adam_w_mode"] = adam_w_mode
    cfg = {
        "train_micro_batch_size_per_gpu": micro // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {"type": optimizer, "params": params},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                 "warmup_num_steps": warmup, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2, "sub_group_size": 200,
                              "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
    }
    for key, value in extra.items():
        cfg[key] = value
    return cfg


def train(model, opt, steps):
    """`steps` steps of the common loop: each rank its shard of common.batch(step)."""
    for step in range(1, steps + 1):
        x, y = batch(step)
        loss_fn(model, shard(x, opt.rank, opt.world_size),
                shard(y, opt.rank, opt.world_size)).backward()
        opt.step()
        opt.zero_grad()


def warmup_lr(step, lr=0.02, warmup=5):
    """DeepSpeed's WarmupLR (linear, from 0) for 1-based step `step`: the scheduler's
    last_batch_iteration is step - 2 (its constructor sets the first step's lr, the min)."""
    i = max(step - 2, 0)
    w = max(2, warmup)
    return lr * (i / w if i < w else 1.0)


def reference(steps, optimizer="AdamW", adam_w_mode=True, lr=0.02, warmup=5, clip=0.5, seed=0):
    """torch's own optimizer over the whole batches, with the same clipping and warmup."""
    model = make_model(seed)
    kwargs = {"lr": lr, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    decoupled = optimizer == "AdamW" or adam_w_mode
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(model.parameters(), **kwargs)
    for step in range(1, steps + 1):
        x, y = batch(step)
        loss_fn(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, lr, warmup)
        opt.step()
        opt.zero_grad()
    return model


def max_relative_error(model, ref):
    """The largest over the parameters of ||a - b|| / ||b||."""
    worst = 0.0
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        err = float((a.detach() - b.detach()).norm() / b.detach().norm())
        worst = max(worst, err)
    return worst


def check(condition, message):
    if not condition:
        print(f"FAIL: {message}", flush=True)
        sys.exit(1)


def report_raised(rank, work, error):
    """Prints "rank R: raised <class>: <message>" and writes it to <work>/rank<R>.txt too:
    mpirun may drop a rank's last output when it ends the job."""
    line = f"rank {rank}: raised {type(error).__name__}: {error}"
    with open(os.path.join(work, f"rank{rank}.txt"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
