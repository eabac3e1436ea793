"""backward+step of zinf.torch at stage 1 with and without overlap_backward, side by side.

  mpirun -np 2 python3 launch/bench-overlap.py --swap /local_nvme/zinf [--layers 48]
      [--width 1024] [--batch 16] [--steps 5] [--rounds 2]

A stack of --layers Linear(width, width) + Tanh layers (many parameters, each complete at its
own point of the backward pass) trains --steps timed steps per mode and round after two warm-up
steps; the modes alternate, their order rotated each round. Prints one JSON object per mode and
round (median seconds of forward, backward, step, backward+step and the swapped optimizer
step inside it, slowest rank) and a summary
with the ratio overlap / plain of backward+step.
"""

import argparse
import json
import os
import statistics
import time

import numpy
import torch

import zinf
import zinf.torch


def run(args, overlap, rank, world):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        # Stage 1: overlap_backward is its option (stages 2 and 3 always hand the gradients).
        "zero_optimization": {"stage": 1, "reduce_bucket_size": args.bucket,
                              "sub_group_size": 1 << 24,
                              "offload_optimizer": {"device": "nvme", "nvme_path": args.swap}},
        "zinf": {"adam_threads": args.threads},
    }
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config, progress=False,
                                   create_nvme_paths=True, overlap_backward=overlap)
    g = torch.Generator().manual_seed(rank)
    times = {"forward": [], "backward": [], "step": [], "backward_step": [], "optimizer": []}
    for step in range(args.steps + 2):
        x = torch.randn(args.batch, args.width, generator=g)
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        info = opt.step(loss=loss)
        opt.zero_grad()
        t3 = time.perf_counter()
        if step >= 2:
            local = numpy.array([t1 - t0, t2 - t1, t3 - t2, t3 - t1, info.optimizer_seconds],
                                dtype=numpy.float32)
            everyone = numpy.empty(len(local) * world, dtype=numpy.float32)
            zinf._zinf.allgatherv(local, everyone, [len(local)] * world,  # the slowest rank's
                                  call="bench-overlap")
            for key, value in zip(times, everyone.reshape(world, -1).max(axis=0).tolist()):
                times[key].append(value)
    opt.close()
    return {key: statistics.median(values) for key, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swap", required=True, help="nvme_path (created if missing)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=4 << 20,
                        help="zero_optimization.reduce_bucket_size (elements)")
    parser.add_argument("--threads", type=int, default=0, help="zinf.adam_threads")
    args = parser.parse_args()
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    os.makedirs(args.swap, exist_ok=True)
    results = {False: [], True: []}
    for round_ in range(args.rounds):
        for overlap in ((False, True) if round_ % 2 == 0 else (True, False)):
            r = run(args, overlap, rank, world)
            results[overlap].append(r["backward_step"])
            if rank == 0:
                print(json.dumps({"round": round_, "overlap_backward": overlap, "ranks": world,
                                  "parameters": args.layers * (args.width + 1) * args.width,
                                  **{f"{k}_seconds": round(v, 4) for k, v in r.items()}}),
                      flush=True)
    if rank == 0:
        plain = statistics.median(results[False])
        overlapped = statistics.median(results[True])
        print(json.dumps({"summary": "backward+step, median over rounds",
                          "plain_seconds": round(plain, 4),
                          "overlap_seconds": round(overlapped, 4),
                          "overlap_over_plain": round(overlapped / plain, 3)}), flush=True)


if __name__ == "__main__":
    main()
