#!/usr/bin/python3
"""zinf.torch resumes from a DeepSpeed checkpoint imported by `zinf-ckpt import-deepspeed`
(driven by deepspeed_import_test.sh torch; tests/python/common.py's model, batches and config:
ZeRO 2 on NVMe, AdamW, WarmupLR, clipping).

  deepspeed_import_torch.py save WORK               2 steps, save with a client state; the file's
                                                    path into WORK/saved
  deepspeed_import_torch.py resume WORK FILE OUT    ZeroOptimizer(load=FILE) on other initial
                                                    weights: step 2 and the client state back,
                                                    2 more steps, the weights into OUT
  deepspeed_import_torch.py compare WORK A B        the weights of A and B equal, bitwise
"""

import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import common  # noqa: E402
import torch  # noqa: E402
import zinf.torch  # noqa: E402

CLIENT = {"epoch": 1, "sampler": {"position": 24, "seed": 7}, "note": "zinf.torch"}


def train(model, opt, first, last):
    for step in range(first, last + 1):
        x, y = common.batch(step)
        common.loss_fn(model, common.shard(x, opt.rank, opt.world_size),
                       common.shard(y, opt.rank, opt.world_size)).backward()
        info = opt.step()
        opt.zero_grad()
        common.check(info.step == step, f"step {info.step} != {step}")


def main():
    mode, work = sys.argv[1], sys.argv[2]
    if mode == "compare":
        a, b = torch.load(sys.argv[3]), torch.load(sys.argv[4])
        common.check(list(a) == list(b), f"parameters {list(a)} != {list(b)}")
        for name in a:
            common.check(torch.equal(a[name], b[name]),
                         f"{name}: resumed from the import differs from resumed from the "
                         f"original by {float((a[name] - b[name]).abs().max()):.3e}")
        print(f"ok: {len(a)} tensors equal after 2 more steps from the import and the original")
        return 0
    swap = os.path.join(work, f"swap-{mode}-{os.path.basename(sys.argv[-1])}")
    cfg = common.config(swap)
    if mode == "save":
        model = common.make_model()
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                       create_nvme_paths=True)
        train(model, opt, 1, 2)
        path = opt.save_checkpoint(os.path.join(work, "ckpt"), client_state=CLIENT)
        opt.close()
        with open(os.path.join(work, "saved"), "w") as f:
            f.write(path)
        return 0
    src, out = sys.argv[3], sys.argv[4]
    model = common.make_model(seed=123)  # other weights: the load replaces them
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True, load=src)
    common.check(opt.global_step == 2, f"global_step {opt.global_step} after loading {src}")
    common.check(opt.client_state == CLIENT, f"client state {opt.client_state} from {src}")
    train(model, opt, 3, 4)
    opt.close()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
