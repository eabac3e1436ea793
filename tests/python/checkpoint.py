"""Checkpoints of zinf.torch.ZeroOptimizer across world sizes (driven by checkpoint_test.sh).

  mpirun -np 2 python3 checkpoint.py save <dir>   5 steps, save with client state, 5 more
  mpirun -np N python3 checkpoint.py load <dir>   load step 5 into other weights, 5 more steps

The loaded weights must equal the saved ones exactly, the client state must come back, and the
weights after the 5 more steps must equal those of the 2-rank run: bitwise on 2 ranks, within
1e-5 relative on other world sizes (fp32 state), or within 1e-3 (q8 state: the moments whose
blocks moved are quantized once more, and the blocks differ from then on).
ZINF_TEST_OPTIMIZER_STATE=q8 runs it with zinf.optimizer_state q8."""

import os
import sys

import torch

import common
import zinf.torch

CLIENT = {"epoch": 7, "note": "saved on 2 ranks", "loader": [1, 2, 3]}


def train(model, opt, first, last):
    for step in range(first, last + 1):
        x, y = common.batch(step)
        loss = common.loss_fn(model, common.shard(x, opt.rank, opt.world_size),
                              common.shard(y, opt.rank, opt.world_size))
        loss.backward()
        info = opt.step(loss=loss)
        opt.zero_grad()
        common.check(info.step == step, f"step {info.step} != {step}")


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main():
    mode, work = sys.argv[1], sys.argv[2]
    ckpt = os.path.join(work, "ckpt")
    state = os.environ.get("ZINF_TEST_OPTIMIZER_STATE", "fp32")
    cfg = common.config(os.path.join(work, "swap"), zinf={"optimizer_state": state})
    if mode == "save":
        model = common.make_model()
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                       create_nvme_paths=True)
        train(model, opt, 1, 5)
        path = opt.save_checkpoint(ckpt, client_state=CLIENT)
        common.check(path.endswith("step-5.h5"), f"saved {path}")
        common.check(opt.state_dict()["zinf"]["checkpoint"] == path, "state_dict names the file")
        if opt.rank == 0:
            torch.save(weights(model), os.path.join(work, "w5.pt"))
        train(model, opt, 6, 10)
        if opt.rank == 0:
            torch.save(weights(model), os.path.join(work, "w10.pt"))
        zinf.log(f"save: {path} on {opt.world_size} ranks")
    else:
        model = common.make_model(seed=123)  # other weights: the restore must replace them
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                       create_nvme_paths=True)
        client = opt.load_checkpoint(os.path.join(ckpt, "latest"))
        common.check(client == CLIENT, f"client state {client} != {CLIENT}")
        common.check(opt.global_step == 5, f"global_step {opt.global_step} after the load")
        common.check(opt.resumed_from.endswith("step-5.h5"), f"resumed from {opt.resumed_from}")
        saved = torch.load(os.path.join(work, "w5.pt"))
        for name, value in weights(model).items():
            common.check(torch.equal(value, saved[name]), f"{name} differs after the load")
        # state_dict points at the file; load_state_dict restores from it again.
        sd = opt.state_dict()
        common.check(sd["zinf"]["checkpoint"] == opt.resumed_from, f"state_dict {sd['zinf']}")
        opt.load_state_dict(sd)
        common.check(opt.global_step == 5, "load_state_dict restored step 5")
        train(model, opt, 6, 10)
        ref = torch.load(os.path.join(work, "w10.pt"))
        worst = max(float((v - ref[k]).norm() / ref[k].norm()) for k, v in weights(model).items())
        zinf.log(f"load ({state}): saved on 2 ranks, continued on {opt.world_size}: max relative "
                 f"error {worst:.2e} after 5 more steps")
        bound = 0.0 if opt.world_size == 2 else (1e-3 if state == "q8" else 1e-5)
        common.check(worst <= bound, f"continued weights differ: {worst:.3e} > {bound}")


if __name__ == "__main__":
    main()
