"""ZeRO stage 2 partitions the gradients: `mpirun -np N python3 stage2_grads.py <dir>`.

At stage 2 every parameter's gradient goes to the engine from its AccumulateGrad hook as the
backward pass completes it (lent: copied into a reduce bucket, reduce-scattered, each rank keeps
its partition), and .grad is None afterwards, so no rank holds the whole gradient (issue 42).

- memory: 32 x Linear(1024, 1024) (128 MiB of fp32 weights). What the process holds between
  steps (its RSS after malloc_trim, once the optimizer is created and after each of three steps,
  over the RSS before the optimizer) must stay below the rank's partition of the gradient (1/N
  of the model, which the engine keeps) plus half the model: the pool and the bounded buffers
  fit, the whole gradient (which stage 2 kept before, in the optimizer's registered buffers)
  does not. Measured between steps, not at the peak: during the backward pass the engine holds
  the reduce buckets still in flight, as many as the reductions lag behind the pass.
- lm: the transformer LM of stage3_modules.py (nn.TransformerEncoderLayer in an
  nn.TransformerEncoder, a head tied to the embedding) built the ordinary way, trained at stage 2
  with offload_optimizer nvme, clipping on, gradient accumulation 1 and 2: after every backward
  pass each .grad is None, and the weights end within 1e-5 relative of torch.optim.AdamW.
"""

import ctypes
import resource
import sys

import torch

import common
import stage3
import stage3_modules
import zinf.torch

MiB = 1 << 20
LAYERS, WIDTH = 32, 1024
_libc = ctypes.CDLL(None)


def held_bytes():
    """This process's RSS with the allocator's free memory given back to the kernel first."""
    _libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_handed(model, when):
    for n, p in model.named_parameters():
        common.check(p.grad is None, f"{when}: {n}.grad is not None; at stage 2 every gradient "
                     "goes to the engine as the backward pass completes it")


def memory(swap, rank, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    size = 4 * sum(p.numel() for p in model.parameters())
    x = torch.randn(64, WIDTH)
    cfg = stage3.config(swap, world, stage=2)
    zero = cfg["zero_optimization"]
    zero["sub_group_size"] = 1 << 18  # the pool: a few MiB
    zero["reduce_bucket_size"] = 1 << 20  # a bucket: about one layer
    zero["allgather_bucket_size"] = 1 << 20
    before = held_bytes()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    held = [held_bytes() - before]
    for step in range(3):
        loss = model(x).square().mean()
        loss.backward()
        check_handed(model, f"memory: backward {step + 1}")
        opt.step(loss=loss)
        opt.zero_grad()
        held.append(held_bytes() - before)
    opt.close()
    bound = size // world + size // 2
    zinf.log(f"memory: {LAYERS} x Linear({WIDTH}, {WIDTH}), {size / MiB:.0f} MiB of fp32 weights "
             f"on {world} rank(s): the optimizer holds "
             f"{', '.join(f'{h / MiB:.0f}' for h in held)} MiB (created, after each step; bound "
             f"{bound / MiB:.0f} MiB: the gradient's partition and half the model)")
    common.check(max(held) < bound, f"memory: rank {rank}: the optimizer at stage 2 holds "
                 f"{max(held) / MiB:.1f} MiB between steps, not less than {bound / MiB:.0f} MiB "
                 f"(the {size // world / MiB:.0f} MiB partition of the gradient and half the "
                 "model): a whole gradient is held")


def lm(swap, rank, world, accumulation):
    make, loss_of = stage3_modules.MODELS["lm"]
    cfg = stage3.config(swap, world, stage=2, accumulation=accumulation)
    torch.manual_seed(0)
    model = make()
    start = weights(model)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    for step in range(1, stage3.STEPS + 1):
        for micro in range(accumulation):
            loss = loss_of(model, step, micro, rank, world)
            loss.backward()
            check_handed(model, f"lm: backward {step}.{micro}")
            if micro + 1 < accumulation:
                opt.accumulate_gradients()
        opt.step(loss=loss)
        opt.zero_grad()
        check_handed(model, f"lm: step {step}")
    final = weights(model)
    opt.close()
    ref = stage3.reference(0, accumulation, make=make, loss_of=loss_of)
    stage3_modules.check_trained(f"stage 2 lm, accumulation {accumulation}, {world} rank(s)",
                                 "lm", final, start, ref)


def main():
    swap = sys.argv[1]
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    memory(swap, rank, world)
    for accumulation in (1, 2):
        lm(swap, rank, world, accumulation)
    zinf.log("stage2_grads: OK")


if __name__ == "__main__":
    main()
