"""ZeRO stage 3 beyond plain training: `mpirun -np N python3 stage3_finetune.py <scratch dir>`.

- frozen: a stock submodule's parameter frozen in the parent's __init__ inside zinf.torch.init
  (self.emb.weight.requires_grad_(False), the usual fine-tuning setup) and one frozen on the
  finished model: ZeroOptimizer(model.named_parameters()) makes them whole again on every rank
  (their initial values), never steps them, and trains the rest within 1e-5 relative of
  torch.optim.AdamW with the same parameters frozen. Freezing a trained parameter after the
  optimizer exists, or unfreezing a frozen one, is a FailedPreconditionError at step() on every
  rank naming the parameter; a frozen partitioned parameter not given to the optimizer is a
  FailedPreconditionError in the forward pass naming it.
- external: a forward that reaches a child's partitioned weight other than by name (through a
  tuple made in __init__), where it is empty, raises a FailedPreconditionError naming it (not
  torch's "mat2 must be a matrix"); registered with zinf.torch.register_external_parameter it
  is gathered around that forward and backward (nn.MultiheadAttention, which reads out_proj's
  parameters by name, is tests/python/stage3_modules.py's).
- half: model.half() with the optimizer open is a FailedPreconditionError in the next forward
  pass and at step() (as at stages 1 and 2), naming the parameter; model.float() undoes it and
  training goes on.
- nested: gathered() scopes nested in one another, and a forward pass inside one, leave the
  outer scope's whole weights in place (before the optimizer, with modify=True, and with it)."""

import os
import sys

import torch

import common
import stage3
import zinf.torch

TOLERANCE = 1e-5


class Frozen(stage3.Net):
    """stage3.Net with the embedding (tied to the head) frozen in __init__, after the
    Embedding's own __init__ partitioned it."""

    def __init__(self):
        super().__init__()
        self.emb.weight.requires_grad_(False)


def expect(what, cls, needles, action):
    try:
        action()
    except cls as e:
        for needle in needles:
            common.check(needle in str(e), f"{what}: {needle!r} is not in the message: {e}")
        return e
    except Exception as e:  # noqa: BLE001 - reported as the failure it is
        common.check(False, f"{what}: raised {type(e).__name__}: {e}, expected {cls.__name__}")
    common.check(False, f"{what}: nothing raised, expected {cls.__name__}")


def build(cfg, make, seed=0):
    torch.manual_seed(seed)
    with zinf.torch.init(cfg):
        return make()


def frozen(swap, rank, world):
    cfg = stage3.config(swap, world)
    model = build(cfg, Frozen)
    common.check(zinf.torch.is_partitioned(model.emb.weight), "emb.weight was not partitioned "
                 "(the test needs it partitioned before the parent froze it)")
    model.fc2.bias.requires_grad_(False)  # frozen on the finished model
    start = stage3.weights(model)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    for name in ("emb.weight", "fc2.bias"):
        p = dict(model.named_parameters())[name]
        common.check(not zinf.torch.is_partitioned(p) and tuple(p.shape) != (0,),
                     f"frozen {name} is not whole after the optimizer's creation: {p.shape}")
        common.check(torch.equal(p.detach(), start[name]), f"frozen {name} lost its values")
    for step in range(1, stage3.STEPS + 1):
        stage3.net_loss(model, step, 0, rank, world).backward()
        opt.step()
    final = stage3.weights(model)
    for name in ("emb.weight", "fc2.bias"):
        common.check(torch.equal(final[name], start[name]), f"frozen {name} was stepped")

    # torch's AdamW on the same model with the same parameters frozen.
    torch.manual_seed(0)
    ref = stage3.Net()
    ref.load_state_dict(start, strict=False)  # head.weight is emb.weight
    ref.emb.weight.requires_grad_(False)
    ref.fc2.bias.requires_grad_(False)
    trained = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trained, lr=0.02, betas=(0.9, 0.99), eps=1e-8,
                                weight_decay=0.05)
    for step in range(1, stage3.STEPS + 1):
        stage3.net_loss(ref, step, 0).backward()
        torch.nn.utils.clip_grad_norm_(trained, 0.5)
        for group in ref_opt.param_groups:
            group["lr"] = common.warmup_lr(step)
        ref_opt.step()
        ref_opt.zero_grad()
    expected = {n: p.detach().clone() for n, p in ref.named_parameters()}
    err = stage3.max_relative_error(final, expected)
    zinf.log(f"stage 3 with frozen parameters, {world} rank(s): max relative error vs torch "
             f"{err:.2e}")
    common.check(err < TOLERANCE, f"relative error {err:.3e} >= {TOLERANCE}")

    # requires_grad changed under the optimizer: refused at step() on every rank.
    stage3.net_loss(model, 1, 0, rank, world).backward()
    model.fc1.weight.requires_grad_(False)
    e = expect("a trained parameter frozen after creation", zinf.errors.FailedPreconditionError,
               ["parameter fc1.weight was frozen (requires_grad_(False)) after the optimizer"],
               opt.step)
    common.check(e.agreed, "the error is not agreed on every rank")
    model.fc1.weight.requires_grad_(True)
    model.fc2.bias.requires_grad_(True)
    e = expect("a frozen parameter unfrozen", zinf.errors.FailedPreconditionError,
               ["parameter fc2.bias was frozen (requires_grad False) when the optimizer was "
                "created"], opt.step)
    common.check(e.agreed, "the error is not agreed on every rank")
    model.fc2.bias.requires_grad_(False)
    opt.close()

    # A frozen partitioned parameter the optimizer was not given stays partitioned: its forward
    # pass says so instead of gathering it beside the engine.
    model = build(cfg, Frozen)
    opt = zinf.torch.ZeroOptimizer([(n, p) for n, p in model.named_parameters()
                                    if p.requires_grad], config=cfg, progress=False)
    expect("a frozen partitioned parameter not given", zinf.errors.FailedPreconditionError,
           ["parameter emb.weight of Frozen is partitioned (stage 3) and frozen",
            "give the optimizer every parameter"],
           lambda: stage3.net_loss(model, 1, 0, rank, world))
    opt.close()


class Aside(torch.nn.Module):
    """Its forward reaches the Linear's weight through a tuple, not as self.fc.weight."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)
        self.aside = (self.fc.weight,)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.aside[0])


def external(swap, rank, world):
    cfg = stage3.config(swap, world)
    model = build(cfg, Aside)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    x, y = common.batch(1)
    expect("a weight reached through a tuple", zinf.errors.FailedPreconditionError,
           ["fc.weight of Aside is partitioned (stage 3) and used where it is empty",
            "register_external_parameter"], lambda: model(x))
    zinf.torch.register_external_parameter(model, model.fc.weight)
    common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world)).backward()
    opt.step()
    stage3.check_empty(model, "after a step with an external parameter")
    opt.close()


def half(swap, rank, world):
    cfg = stage3.config(swap, world)
    model = build(cfg, stage3.Net)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    stage3.net_loss(model, 1, 0, rank, world).backward()
    opt.step()
    model.half()
    expect("model.half(), then a forward pass", zinf.errors.FailedPreconditionError,
           ["parameter emb.weight of Net is partitioned (stage 3) and was converted to "
            "torch.float16 on cpu", "while a ZeroOptimizer holds it"],
           lambda: stage3.net_loss(model, 2, 0, rank, world))
    e = expect("model.half(), then step()", zinf.errors.FailedPreconditionError,
               ["parameter emb.weight is partitioned (stage 3) and was converted to "
                "torch.float16"], opt.step)
    common.check(e.agreed, "the error is not agreed on every rank")
    model.float()
    stage3.net_loss(model, 2, 0, rank, world).backward()
    info = opt.step()
    common.check(info.step == 2, f"step {info.step} after model.float()")
    opt.close()


def nested(swap, rank, world):
    cfg = stage3.config(swap, world)
    model = build(cfg, stage3.Net)
    x = stage3.batch(0, 0)[0]

    def check_outer(expected, when):
        for n, p in model.named_parameters():
            common.check(tuple(p.shape) == zinf.torch.partitioned_shape(p),
                         f"{n} is {tuple(p.shape)} in the outer gathered() {when}")
            common.check(torch.equal(p.detach(), expected[n]),
                         f"{n} changed in the outer gathered() {when}")

    # Before the optimizer: values set in an outer modify=True scope survive inner scopes and
    # a forward pass, and become every rank's on its exit.
    torch.manual_seed(11)
    values = stage3.Net().state_dict()
    with zinf.torch.gathered(model, modify=True):
        model.load_state_dict(values)
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
        with zinf.torch.gathered(model.fc1.parameters()):
            with zinf.torch.gathered([model.fc1.weight, model.emb.weight]):
                pass
        check_outer(mine, "after inner scopes exited (before the optimizer)")
        with torch.no_grad():
            stage3.loss_fn(model, x, x)
        check_outer(mine, "after a forward pass inside it (before the optimizer)")
    err = stage3.max_relative_error(stage3.weights(model), values)
    common.check(err == 0, f"gathered(modify=True) with nested scopes lost the values: {err}")

    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    stage3.net_loss(model, 1, 0, rank, world).backward()
    opt.step()
    with zinf.torch.gathered(model.parameters()):
        outer = {n: p.detach().clone() for n, p in model.named_parameters()}
        with zinf.torch.gathered(model.fc2.parameters()):
            pass
        check_outer(outer, "after an inner scope exited")
        with torch.no_grad():
            stage3.loss_fn(model, x, x)
        check_outer(outer, "after a no_grad forward pass inside it")
        loss = stage3.loss_fn(model, x, x)
        check_outer(outer, "after a forward pass inside it")
        loss.backward()
        check_outer(outer, "after a backward pass inside it")
    stage3.check_empty(model, "after the outer gathered() exited")
    opt.step()
    opt.close()


def main():
    swap = sys.argv[1]
    os.makedirs(swap, exist_ok=True)
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    for case in (frozen, external, half, nested):
        case(swap, rank, world)
        zinf.log(f"stage3_finetune: {case.__name__} OK")
    zinf.log("stage3_finetune: OK")


if __name__ == "__main__":
    main()
