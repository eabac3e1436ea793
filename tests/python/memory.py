"""What zinf.torch.ZeroOptimizer adds to the process's peak RSS: `python3 memory.py <swap dir>`.

A model of 16.8M parameters (64 MiB of float32 weights) whose Adam state (fp32 master weights,
exp_avg, exp_avg_sq: 192 MiB per rank on one rank) is 6 times the 32 MiB pool
(zinf.pinned_budget_bytes). The baseline is the peak RSS once the model was created, MPI started
and one forward/backward pass allocated the gradients (what any optimizer starts from); creating
the optimizer and 5 steps must add less than the pool + SLACK, with the gradients swapped
(zinf.swap_gradients, gradient_memory_limit 0). SLACK is well under the model's size, so the
engine cannot hold a copy of the weights or of the partition's gradient."""

import resource
import sys

import torch

import common
import zinf.torch

MiB = 1 << 20
POOL = 32 * MiB
SLACK = 24 * MiB  # Python, torch's allocator, MPI and the engine's bounded buffers


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main():
    swap = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(64)])
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, 512)

    def forward_backward():
        loss = model(x).square().mean()
        loss.backward()
        return loss

    forward_backward()
    zinf.init()
    baseline = peak_rss()
    cfg = common.config(swap, micro=8, clip=1.0, warmup=2)
    cfg["zero_optimization"]["sub_group_size"] = 1 << 18  # 1 MiB per state tensor
    cfg["zero_optimization"]["reduce_bucket_size"] = 1 << 18
    cfg["zero_optimization"]["allgather_bucket_size"] = 1 << 18
    cfg["zinf"] = {"pinned_budget_bytes": POOL, "swap_gradients": True}
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   gradient_memory_limit=0)
    for _ in range(5):
        loss = forward_backward()
        info = opt.step(loss=loss)
    opt.close()
    added = peak_rss() - baseline
    state = 3 * 4 * numel // opt.world_size
    zinf.log(f"memory: {numel} parameters, Adam state {state / MiB:.1f} MiB per rank = "
             f"{state / POOL:.1f} x the {POOL / MiB:.0f} MiB pool; peak RSS {baseline / MiB:.1f} "
             f"MiB after the model, +{added / MiB:.1f} MiB by the optimizer and "
             f"{info.step} steps (bound: pool + {SLACK / MiB:.0f} MiB)")
    common.check(state >= 4 * POOL, "the state must be several times the pool")
    common.check(added < POOL + SLACK, f"the optimizer added {added / MiB:.1f} MiB of peak RSS")


if __name__ == "__main__":
    main()
