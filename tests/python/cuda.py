"""zinf.torch with CUDA parameters (staged through pinned host buffers): the model on the GPU,
20 steps, weights equal to torch.optim.AdamW on the CPU within 1e-5 relative. Prints "SKIP:
<reason>" and exits 0 where torch sees no GPU. `mpirun -np N python3 cuda.py <swap dir>`."""

import sys

import torch

import common
import zinf.torch

STEPS = 20


def main():
    if not torch.cuda.is_available():
        print("SKIP: torch.cuda.is_available() is False (no GPU or no CUDA build of torch); "
              "the CUDA staging path of zinf.torch is not exercised", flush=True)
        return
    swap = sys.argv[1]
    facts = zinf.init()
    torch.cuda.set_device(facts["local_rank"] % torch.cuda.device_count())
    model = common.make_model().cuda()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=common.config(swap),
                                   progress=False, create_nvme_paths=True)
    for step in range(1, STEPS + 1):
        x, y = common.batch(step)
        x = common.shard(x, opt.rank, opt.world_size).cuda()
        y = common.shard(y, opt.rank, opt.world_size).cuda()
        common.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    err = common.max_relative_error(model.cpu(), common.reference(STEPS))
    zinf.log(f"cuda: {STEPS} steps on {opt.world_size} rank(s), max relative error vs torch "
             f"{err:.2e}")
    # GPU matmuls (TF32 off by default for fp32 in torch) differ from the CPU's in rounding only.
    common.check(err < 1e-4, f"relative error {err:.3e}")


if __name__ == "__main__":
    main()
