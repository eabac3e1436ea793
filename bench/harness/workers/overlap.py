"""The ranks of `bench/run.py overlap` (bench/harness/overlap.py; its --help says what each mode
and figure means), run by it under mpirun:

  mpirun -np 2 python3 bench/harness/workers/overlap.py --path DIR [the other flags of
      bench/run.py overlap, which it parses with the harness's own add_arguments]

A stack of --layers Linear(width, width) + Tanh layers trains --steps timed steps per mode and
round after two warm-up steps, its optimizer state swapped to --path (offload_optimizer nvme);
every mode builds the same model (seed 0) and feeds it the same data (seed = rank), the modes'
order rotated each round. Rank 0 prints one JSON line per mode and round (the medians over the
timed steps, slowest rank), then the summary line (medians over the rounds and their ratios).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy
import torch

import zinf
import zinf.torch

# The flags are bench/run.py overlap's own (bench/harness/overlap.py), parsed and checked alike.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness import overlap as harness_overlap  # noqa: E402

# name: (zero_optimization.stage, overlap_backward, zinf.speculative_step or None for unset)
MODES = {
    "plain": (1, False, False),
    "overlap": (1, True, False),
    "speculative": (1, True, True),
    "stage2": (2, False, None),
}
TIMES = ("forward", "backward", "step", "backward_step", "optimizer", "zero_grad")
COUNTERS = ("speculated", "speculation_committed", "speculation_redone", "speculation_discarded")


def run(args, mode, rank, world):
    stage, overlap, speculative = MODES[mode]
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    zinf_keys = {"adam_threads": args.threads}
    if speculative is not None:
        zinf_keys["speculative_step"] = speculative
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1e-6 if args.clip_every_step else 1.0,
        "steps_per_print": 1 if args.breakdown else 1000,
        "wall_clock_breakdown": args.breakdown,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        # Stage 1: overlap_backward is its option (stages 2 and 3 always hand the gradients).
        "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket,
                              "sub_group_size": args.sub_group,
                              "offload_optimizer": {"device": "nvme", "nvme_path": args.path}},
        "zinf": zinf_keys,
    }
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config, progress=args.breakdown,
                                   create_nvme_paths=True,
                                   overlap_backward=overlap if stage == 1 else False)
    g = torch.Generator().manual_seed(rank)
    times = {key: [] for key in TIMES}
    counters = dict.fromkeys(COUNTERS, 0)
    clipped, norms, io, loss_value = 0, [], [], None
    for step in range(args.steps + 2):
        x = torch.randn(args.batch, args.width, generator=g)
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        info = opt.step(loss=loss)
        t3 = time.perf_counter()
        opt.zero_grad()
        t4 = time.perf_counter()
        if step >= 2:
            local = numpy.array([t1 - t0, t2 - t1, t4 - t2, t4 - t1, info.optimizer_seconds,
                                 t4 - t3], dtype=numpy.float32)
            everyone = numpy.empty(len(local) * world, dtype=numpy.float32)
            zinf._zinf.allgatherv(local, everyone, [len(local)] * world,  # the slowest rank's
                                  call="bench-overlap")
            for key, value in zip(times, everyone.reshape(world, -1).max(axis=0).tolist()):
                times[key].append(value)
            for key in COUNTERS:  # already summed over the ranks
                counters[key] += getattr(info, key)
            clipped += bool(info.clipped)
            norms.append(info.grad_norm)
            io.append((info.swap_read_bytes, info.swap_write_bytes,
                       info.optimizer_swap_read_bytes, info.optimizer_swap_write_bytes))
            loss_value = info.loss
    opt.close()
    result = {f"{key}_seconds": statistics.median(values) for key, values in times.items()}
    result.update(counters)
    result["clipped_steps"] = clipped
    result["grad_norm"] = statistics.median(norms)
    for i, key in enumerate(("swap_read", "swap_write", "optimizer_swap_read",
                             "optimizer_swap_write")):
        result[f"{key}_mb_per_rank"] = statistics.median(b[i] for b in io) / world / 1e6
    result["last_loss"] = loss_value
    return result


def ratio(a, b):
    return round(a / b, 3) if b > 0 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness_overlap.add_arguments(parser)
    args = parser.parse_args()
    modes = args.modes
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    # The ranks of a node share its cores: one torch pool each of cores / ranks threads.
    torch.set_num_threads(args.torch_threads or
                          max(1, (os.cpu_count() or 1) // facts["local_size"]))
    os.makedirs(args.path, exist_ok=True)
    parameters = args.layers * (args.width + 1) * args.width
    per_rank = -(-parameters // world)
    results = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        shift = round_ % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            r = run(args, mode, rank, world)
            results[mode].append(r)
            if rank == 0:
                stage, overlap, speculative = MODES[mode]
                print(json.dumps({
                    "round": round_, "mode": mode, "stage": stage, "overlap_backward": overlap,
                    "speculative_step": speculative, "clip_every_step": args.clip_every_step,
                    "ranks": world, "parameters": parameters,
                    "sub_groups_per_rank": -(-per_rank // args.sub_group),
                    "batch": args.batch,
                    **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}),
                      flush=True)
    if rank != 0:
        return

    def median(mode, key):
        return statistics.median(r[key] for r in results[mode])

    summary = {"summary": "medians over rounds of each mode's median seconds",
               "clip_every_step": args.clip_every_step, "rounds": args.rounds}
    for mode in modes:
        for key in ("backward", "step", "backward_step", "optimizer"):
            summary[f"{mode}_{key}_seconds"] = round(median(mode, f"{key}_seconds"), 4)
        if MODES[mode][2] is not False:
            summary[f"{mode}_speculated"] = sum(r["speculated"] for r in results[mode])
            summary[f"{mode}_committed"] = sum(r["speculation_committed"]
                                               for r in results[mode])
            summary[f"{mode}_redone"] = sum(r["speculation_redone"] for r in results[mode])

    def ratios(name, top, bottom):
        """Medians' ratio and the per-round ratios (modes of the same round)."""
        summary[name] = ratio(top(statistics.median), bottom(statistics.median))
        summary[f"{name}_per_round"] = [
            ratio(top(lambda v, i=i: v[i]), bottom(lambda v, i=i: v[i]))
            for i in range(args.rounds)]

    def pick(mode, key):
        return lambda f: f([r[f"{key}_seconds"] for r in results[mode]])

    if "speculative" in modes and "plain" in modes:
        ratios("speculative_over_max_plain", pick("speculative", "backward_step"),
               lambda f: max(pick("plain", "backward")(f), pick("plain", "step")(f)))
        ratios("speculative_step_over_plain", pick("speculative", "step"),
               pick("plain", "step"))
    if "speculative" in modes and "overlap" in modes:
        ratios("speculative_over_overlap", pick("speculative", "backward_step"),
               pick("overlap", "backward_step"))
    if "overlap" in modes and "plain" in modes:
        ratios("overlap_over_plain", pick("overlap", "backward_step"),
               pick("plain", "backward_step"))
    # The goals: the first without clipping, the second with clipping at every step.
    summary["goal"] = ({"speculative_over_overlap": 1.10} if args.clip_every_step
                       else {"speculative_over_max_plain": 1.15})
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
