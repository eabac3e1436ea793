"""zinf.torch.ZeroOptimizer against torch's own optimizer, and data parallel against the whole
batch: `mpirun -np N python3 exactness.py <swap dir>`. Every rank trains on its shard of each
global batch; the weights after STEPS steps must equal torch.optim.AdamW/Adam on the whole batch
(same clipping and warmup) within 1e-5 relative, for AdamW, Adam with adam_w_mode and Adam
without it (L2 weight decay)."""

import sys

import torch

import common
import zinf.torch

STEPS = 20
TOLERANCE = 1e-5


def run(swap, optimizer, adam_w_mode):
    model = common.make_model()
    cfg = common.config(swap, optimizer=optimizer, adam_w_mode=adam_w_mode)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    rank, world = opt.rank, opt.world_size
    clipped = 0
    for step in range(1, STEPS + 1):
        x, y = common.batch(step)
        loss = common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world))
        loss.backward()
        info = opt.step(loss=loss)
        opt.zero_grad()
        common.check(info.step == step, f"StepInfo.step {info.step} != {step}")
        common.check(abs(info.lr - common.warmup_lr(step)) < 1e-12, f"lr {info.lr} at {step}")
        common.check(opt.param_groups[0]["lr"] == opt._engine.next_lr, "param_groups lr")
        clipped += info.clipped
    opt.close()
    ref = common.reference(STEPS, optimizer=optimizer,
                           adam_w_mode=adam_w_mode if adam_w_mode is not None else True)
    err = common.max_relative_error(model, ref)
    zinf.log(f"{optimizer} adam_w_mode={adam_w_mode} on {world} rank(s): {STEPS} steps "
             f"({clipped} clipped), max relative weight error vs torch {err:.2e}")
    common.check(clipped > 0, "the test must exercise clipping")
    common.check(err < TOLERANCE, f"{optimizer}/{adam_w_mode}: relative error {err:.3e} "
                 f">= {TOLERANCE}")
    # Not trivially equal: the weights moved.
    moved = common.max_relative_error(model, common.make_model())
    common.check(moved > 1e-3, f"the weights barely moved ({moved:.2e})")


def main():
    swap = sys.argv[1]
    for optimizer, adam_w_mode in (("AdamW", None), ("Adam", True), ("Adam", False)):
        run(swap, optimizer, adam_w_mode)
    zinf.log("exactness: OK")


if __name__ == "__main__":
    main()
