"""Gradients handed to the engine before step(): with overlap_backward (stage 1), at stages 2
and 3 (where every gradient is), and by accumulate_gradients().
`mpirun -np N python3 handed.py <work>`.

mishaps (gradient_accumulation_steps 1; overlap_backward, stage 2, then stage 3): 10 steps of
common.make_model on its batches 1..10 (each rank its shard), with a mishap before some of them;
each raises the same error on every rank (or none), and the loop goes on without
load_checkpoint:

  - a .grad set after backward() on a handed parameter (on the last rank only): step() raises
    FailedPreconditionError on every rank naming the parameter, nothing stepped; with .grad
    set back to None the handed gradient is stepped;
  - a NaN batch: step() refuses it (not finite), and the next batch trains;
  - one backward pass too many: the second pass raises FailedPreconditionError, the step's
    gradient dropped on every rank;
  - a closure that raises after its backward pass: the next step(closure), whose closure begins
    with zero_grad() as torch's do, drops that gradient and steps its own;
  - zero_grad() after a backward pass drops that batch (also after a .grad set on a handed
    parameter);
  - accumulate_gradients() refused (gradient_accumulation_steps 1): the step's gradient dropped.

accumulation (gradient_accumulation_steps 2, each step's micro-batches the halves of the
rank's shard; overlap_backward, stages 2 and 3, stage 1 with accumulate_gradients(), and
overlap_backward with zinf.swap_gradients on NVMe): a third micro-batch refused, zero_grad()
after one and after two micro-batches, a NaN in the second, and (overlap_backward, stages 2
and 3) a .grad set on a handed parameter between two passes, refused by the next pass; each
drops the step's gradient on every rank and the next step counts only its own micro-batches.

The weights then equal torch.optim.AdamW over the good batches only (same clipping and warmup)
within 1e-5 relative, and the optimizer counts only the steps taken.
"""

import math
import os
import re
import sys

import torch

import common
import zinf
import zinf.torch
from zinf import _zinf

STEPS = 10
TOLERANCE = 1e-5


def agree_ok(what, problem):
    """A failure on any rank fails the sub-case on every rank."""
    _zinf.agree("Internal", f"{what}: {problem}" if problem else "", call="handed.py")


def weights(model):
    """The whole weights of `model` (gathered at stage 3), copied."""
    with zinf.torch.gathered(model.parameters()):
        return [p.detach().clone() for p in model.parameters()]


def unchanged(model, what, before):
    """Agreed: `model`'s weights are still `before` after `what`."""
    agree_ok(what, "" if all(torch.equal(a, b) for a, b in zip(before, weights(model)))
             else "the weights changed")


def expect_error(what, cls, pattern, action):
    try:
        action()
        problem = f"nothing raised (expected {cls.__name__} matching {pattern!r})"
    except zinf.ZinfError as e:
        problem = ("" if isinstance(e, cls) and re.search(pattern, str(e)) and e.agreed
                   else f"expected {cls.__name__} matching {pattern!r} on every rank, got "
                        f"{e!r} (agreed {e.agreed})")
    agree_ok(what, problem)


def mishaps(mode, work):
    """gradient_accumulation_steps 1, overlap_backward ("overlap", stage 1), stage 2 ("stage2")
    or stage 3 ("stage3")."""
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    swap = os.path.join(work, mode)
    os.makedirs(swap, exist_ok=True)
    cfg = common.config(swap, world=world)
    cfg["zero_optimization"]["stage"] = 1 if mode == "overlap" else 2  # overlap_backward: stage 1's
    if mode == "stage3":
        zero = cfg["zero_optimization"]
        zero.update(stage=3, stage3_param_persistence_threshold=100,
                    offload_param={"device": "none"})
        with zinf.torch.init(cfg):
            model = common.make_model()
        agree_ok("stage 3", "" if all(p.numel() == 0 for p in model.parameters() if p.dim() == 2)
                 else "the weights are not partitioned")
    else:
        model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   overlap_backward=mode == "overlap")
    named = dict(model.named_parameters())
    weight = named["2.weight"]

    def loss_of(step):
        x, y = common.batch(step)
        return common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world))

    def bad(step):  # a batch that must not count
        return loss_of(100 + step)

    def backward(step):
        loss = loss_of(step)
        loss.backward()
        return loss

    def set_grad(p, last_rank_only=False):
        # At stage 3 p.data is empty outside gathered(): torch takes a whole .grad only there.
        with zinf.torch.gathered([p]):
            if not last_rank_only or rank == world - 1:
                p.grad = torch.ones_like(p)

    def handed(what):
        agree_ok(what, "" if all(p.grad is None for p in model.parameters())
                 else "a .grad is not None after backward(): not handed")

    for step in range(1, STEPS + 1):
        before = weights(model)
        if step == 2:
            # A .grad written after backward() on a handed parameter (on the last rank only):
            # refused on every rank, nothing stepped; set back to None, the handed gradient is
            # stepped.
            loss = backward(step)
            handed("backward")
            set_grad(weight, last_rank_only=True)
            expect_error("a .grad set after backward()", zinf.errors.FailedPreconditionError,
                         r"parameter 2\.weight: its \.grad was set after the backward pass "
                         r"handed its gradient to the engine.*set \.grad to None.*zero_grad\(\)",
                         lambda: opt.step(loss=loss))
            unchanged(model, "a refused .grad", before)
            weight.grad = None
            opt.step(loss=loss)
        elif step == 3:
            # A NaN batch: refused on every rank, its gradient consumed.
            loss = bad(step) * math.nan
            loss.backward()
            expect_error("a NaN batch", zinf.errors.FailedPreconditionError, "not finite",
                         lambda: opt.step(loss=loss))
            unchanged(model, "a NaN batch", before)
            opt.step(loss=backward(step))
        elif step == 4:
            # One backward pass too many (gradient_accumulation_steps 1): the second raises and
            # drops the step's gradient.
            bad(step).backward()
            expect_error("a second backward pass", zinf.errors.FailedPreconditionError,
                         r"began micro-batch 2 of the step.*gradient_accumulation_steps 1.*"
                         r"dropped on every rank",
                         lambda: bad(step + 50).backward())
            unchanged(model, "a second backward pass", before)
            opt.step(loss=backward(step))
        elif step == 5:
            # A closure that raises after its backward pass; the next closure zeroes first.
            def failing():
                bad(step).backward()
                raise ValueError("the closure failed")

            try:
                opt.step(failing)
                problem = "the closure's error did not come through"
            except ValueError:
                problem = ""
            agree_ok("a closure that raises", problem)
            unchanged(model, "a closure that raises", before)

            def closure():
                opt.zero_grad()
                return backward(step)

            opt.step(closure)
        elif step == 6:
            # zero_grad() after a handed backward pass drops that batch.
            bad(step).backward()
            handed("a bad backward")
            opt.zero_grad()
            unchanged(model, "zero_grad", before)
            opt.step(loss=backward(step))
        elif step == 7:
            # A .grad set after backward() on a handed parameter, then zero_grad(): dropped too.
            bad(step).backward()
            set_grad(weight)
            opt.zero_grad()
            opt.step(loss=backward(step))
        elif step == 8:
            # accumulate_gradients() refused (gradient_accumulation_steps 1): dropped.
            bad(step).backward()
            expect_error("accumulate_gradients", zinf.errors.FailedPreconditionError,
                         "AccumulateGradients called 1 times", opt.accumulate_gradients)
            unchanged(model, "accumulate_gradients", before)
            opt.step(loss=backward(step))
        else:
            opt.step(loss=backward(step))
        opt.zero_grad()

    final = weights(model)
    ref = common.reference(STEPS)
    worst = max(float((a - b.detach()).norm() / b.detach().norm())
                for a, b in zip(final, ref.parameters()))
    moved = max(float((a - b.detach()).norm() / b.detach().norm())
                for a, b in zip(final, common.make_model().parameters()))
    zinf.log(f"handed ({mode}), {world} rank(s): {STEPS} steps through the mishaps, max relative "
             f"weight error vs torch.optim.AdamW on the good batches {worst:.2e}")
    agree_ok("global_step", "" if opt.global_step == STEPS else f"global_step {opt.global_step}")
    agree_ok("exact", "" if worst < TOLERANCE and moved > 1e-3
             else f"relative error {worst:.3e}, moved {moved:.3e}")
    opt.close()


def accumulation(mode, work, swap_gradients=False):
    """gradient_accumulation_steps 2 (module docstring). `mode`: overlap (stage 1), stage2,
    stage3 (each backward pass a micro-batch, the second handing the first over) or plain
    (stage 1, accumulate_gradients() between the passes)."""
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    swap = os.path.join(work, f"{mode}-accumulation{'-swapped' if swap_gradients else ''}")
    os.makedirs(swap, exist_ok=True)
    cfg = common.config(swap, world=world, micro=common.BATCH // 2, gradient_accumulation_steps=2)
    if swap_gradients:  # the partition's gradient accumulated on NVMe (read-add-write)
        cfg["zinf"] = {"swap_gradients": True}
    cfg["zero_optimization"]["stage"] = 1 if mode in ("overlap", "plain") else 2
    if mode == "stage3":
        cfg["zero_optimization"].update(stage=3, stage3_param_persistence_threshold=100,
                                        offload_param={"device": "none"})
        with zinf.torch.init(cfg):
            model = common.make_model()
    else:
        model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   overlap_backward=mode == "overlap",
                                   gradient_memory_limit=0 if swap_gradients else 256 << 20)
    steps = 8
    named = dict(model.named_parameters())

    def set_grad(p, last_rank_only):  # stage 3: a whole .grad only inside gathered()
        with zinf.torch.gathered([p]):
            if not last_rank_only or rank == world - 1:
                p.grad = torch.ones_like(p)

    def micro(step, k, scale=1.0):
        x, y = common.batch(step)
        x, y = common.shard(x, rank, world), common.shard(y, rank, world)
        n = x.shape[0] // 2
        loss = common.loss_fn(model, x[k * n:(k + 1) * n], y[k * n:(k + 1) * n]) * scale
        loss.backward()
        if mode == "plain" and k == 0:
            opt.accumulate_gradients()
        return loss

    for step in range(1, steps + 1):
        before = weights(model)
        if step == 2:  # a third micro-batch
            micro(step, 0)
            micro(step, 1)
            if mode == "plain":
                expect_error("a third micro-batch", zinf.errors.FailedPreconditionError,
                             "AccumulateGradients called 2 times", opt.accumulate_gradients)
            else:
                expect_error("a third micro-batch", zinf.errors.FailedPreconditionError,
                             r"began micro-batch 3 of the step.*dropped on every rank",
                             lambda: micro(step + 50, 1))
            unchanged(model, "a third micro-batch", before)
        elif step == 3:  # zero_grad() after one bad micro-batch
            micro(step + 50, 0)
            opt.zero_grad()
        elif step == 4:  # zero_grad() after two bad micro-batches
            micro(step + 50, 0)
            micro(step + 50, 1)
            opt.zero_grad()
            unchanged(model, "zero_grad", before)
        elif step == 5:  # a NaN in the second micro-batch
            micro(step, 0)
            loss = micro(step, 1, math.nan)
            expect_error("a NaN micro-batch", zinf.errors.FailedPreconditionError, "not finite",
                         lambda: opt.step(loss=loss))
            unchanged(model, "a NaN micro-batch", before)
        elif step in (6, 7) and mode != "plain":
            # A .grad set on a handed parameter between two passes: the next pass refuses it
            # (whichever of the two last parameters' gradients that pass completes first).
            micro(step + 50, 0)
            set_grad(named["4.weight" if step == 6 else "4.bias"], last_rank_only=step == 7)
            expect_error("a .grad set between two passes", zinf.errors.FailedPreconditionError,
                         r"parameter 4\.(weight|bias): its \.grad was set after the backward "
                         r"pass handed.*cannot add to it either.*dropped on every rank",
                         lambda: micro(step + 50, 1))
            unchanged(model, "a .grad set between two passes", before)
        micro(step, 0)
        opt.step(loss=micro(step, 1))
        opt.zero_grad()

    final = weights(model)
    ref = common.reference(steps)
    worst = max(float((a - b.detach()).norm() / b.detach().norm())
                for a, b in zip(final, ref.parameters()))
    zinf.log(f"handed ({mode}, gradient_accumulation_steps 2"
             f"{', swap_gradients' if swap_gradients else ''}), {world} rank(s): {steps} steps "
             f"through the mishaps, max relative weight error vs torch.optim.AdamW {worst:.2e}")
    agree_ok("global_step", "" if opt.global_step == steps else f"global_step {opt.global_step}")
    agree_ok("exact", "" if worst < TOLERANCE else f"relative error {worst:.3e}")
    opt.close()


def main():
    work = sys.argv[1]
    mishaps("overlap", work)
    mishaps("stage2", work)
    mishaps("stage3", work)
    accumulation("overlap", work)
    accumulation("stage2", work)
    accumulation("stage3", work)
    accumulation("plain", work)
    accumulation("overlap", work, swap_gradients=True)
    print(f"rank {zinf.init()['rank']}: OK", flush=True)


if __name__ == "__main__":
    main()
