"""backward+step of zinf.torch at stage 1: plain, reduce-only overlap and the speculative step.

  mpirun -np 2 python3 launch/bench-overlap.py --swap /local_nvme/zinf [--layers 32]
      [--width 1024] [--batch 256] [--steps 5] [--rounds 2] [--clip-every-step]
      [--modes plain,overlap,speculative[,stage2]] [--breakdown]

A stack of --layers Linear(width, width) + Tanh layers (many parameters, each complete at its
own point of the backward pass) trains --steps timed steps per mode and round after two warm-up
steps, its optimizer state swapped to --swap (offload_optimizer nvme). Every mode builds the
same model (seed 0) and feeds it the same data (seed = rank), with the same config but for the
keys that make the mode; the modes' order is rotated each round. The modes:

  plain        stage 1, overlap_backward=False, zinf.speculative_step false: step() reduces the
               gradient, then steps the swapped optimizer state.
  overlap      stage 1, overlap_backward=True, zinf.speculative_step false: the reduction runs
               during the backward pass (reduce-only overlap); step() steps the swapped state.
  speculative  stage 1, overlap_backward=True, zinf.speculative_step true: also each sub-group
               whose reduced gradient is final is stepped during the backward pass, into a
               spare slot on disk, and step() commits it (or, clipping applied, steps it again).
  stage2       (only with --modes) stage 2, speculative_step left unset (on: the gradients are
               lent). Stage 2 changes more than the speculation (no .grad buffers, the
               gradients partitioned as they arrive), so it is not the speculative mode's
               reference comparison; it is there to show that stage 2 gets the same benefit.

The speculative mode is stage 1 with overlap_backward=True and speculative_step true, not stage
2, so that it differs from `overlap` in that one key: what it gains or loses against `overlap`
is the speculation's. (Speculating, the engine partitions per parameter, not flat: each rank
owns a part of every parameter so that its partition fills from its end as the backward pass
goes. That is part of the speculative step and is measured with it.)

Prints one JSON object per mode and round: the medians over the timed steps (slowest rank) of
forward, backward (loss.backward()), step (the step() call after it and zero_grad()),
backward_step (their sum), zero_grad (its part of step) and optimizer (info.optimizer_seconds:
the swapped optimizer step inside step(); in the speculative mode only what was left of it for
step(), the speculated part ran during the backward pass), the speculation counters summed
over the timed steps (speculated, speculation_committed, speculation_redone,
speculation_discarded; sub-groups of all ranks), the steps clipped, the median grad_norm, the
swap MB per step and rank (all of the step's since the previous one, and those inside the
optimizer step) and the last loss (the modes train the same model on the same data: the losses
agree to rounding). Then a summary line with the medians over the rounds, the speculation
counters summed over them, and the ratios of the medians (and, `_per_round`, of each round's):

  speculative_over_max_plain  speculative backward_step / max(plain backward, plain step)
                              (goal without --clip-every-step: <= 1.15)
  speculative_step_over_plain speculative step / plain step
  speculative_over_overlap    speculative backward_step / overlap backward_step
                              (goal with --clip-every-step: <= 1.10)

"Backward alone" is the plain mode's backward: autograd's compute with nothing beside it (no
hooks, no reduction, no swap I/O). "Step alone" is the plain mode's step(): the reduction, the
swapped optimizer step and the weights' gather, with no compute beside it: all that the overlap
modes try to move behind the backward pass. max(the two) is what backward+step would take if
it all hid perfectly, which is the speculative step's promise; the 15% are what it may cost
over that. The reference is strict: plain step() contains work that no overlap hides (the
gradient norm waits for the last bucket; the weights' gather, the commit and the sub-groups
completed last run after the backward pass), and in the other modes the backward pass shares
the CPU with the reduction and the speculated Adam (2 ranks on 2 cores leave no idle core),
which plain backward does not, so max() itself is out of reach. The plain mode's
optimizer_seconds (the swap I/O alone) would be a stricter "step alone" still, and a wrong one:
the reduction and the gather are work the step must do too. speculative_step_over_plain shows
how much of step() moved into the backward pass; speculative_over_overlap what the speculation
adds to reduce-only overlap (with --clip-every-step every speculated sub-group is stepped again
in step(): the speculation's cost when it is always wasted).

The default shape: 32 x Linear(1024, 1024) = 33.6M parameters, 200 MB of fp32 Adam state
(weights, m, v) per rank on 2 ranks, read and written at every step (the speculative mode's swap
store is twice that: a second slot per sub-group). The step is bound by the I/O, not by Adam:
CpuAdam steps a rank's 16.8M elements in about 10 ms on one core (zinf-bench adam), the swap
moves 200 MB each way per rank. A batch of 256 per rank makes the plain backward pass about as
long as the plain step() (0.38 and 0.44 s on the 2-core VM with one virtio disk of
docs/benchmarks.md, both up to 2x that with other jobs beside it), where the overlap matters
most: with one much longer than the other, max() is the longer one whatever the overlap does.
Another machine balances at another --batch (--layers scales both): make plain backward_seconds
~ plain step_seconds. --sub-group 1M elements gives 17 sub-groups per rank and --bucket 4M
elements 9 reduce buckets (4 parameters each), so that the first sub-groups' gradients are final
early in the backward pass and the speculation has work to overlap; the same sizes are given in
every mode (given keys are kept as given: the engine shapes them for the speculation only where
they are unset). --breakdown adds the engine's step line and cumulative timers (reduce_scatter,
allgather, optimizer_step) after every step, as log lines between the JSON ones.

--clip-every-step sets gradient_clipping to 1e-6, so that every step clips (the default 1.0 is
DeepSpeed's and this model's gradient norm stays below it: clipped_steps says so per mode).
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
                              "offload_optimizer": {"device": "nvme", "nvme_path": args.swap}},
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
    parser.add_argument("--swap", required=True, help="nvme_path (created if missing)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=4 << 20,
                        help="zero_optimization.reduce_bucket_size (elements)")
    parser.add_argument("--sub-group", type=int, default=1 << 20,
                        help="zero_optimization.sub_group_size (elements)")
    parser.add_argument("--threads", type=int, default=0, help="zinf.adam_threads")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads per rank; 0: the cores / ranks on the node")
    parser.add_argument("--clip-every-step", action="store_true",
                        help="gradient_clipping 1e-6: every step clips (the speculation is "
                             "stepped again in step())")
    parser.add_argument("--breakdown", action="store_true",
                        help="wall_clock_breakdown: the engine logs a step line and its "
                             "timers at every step (not JSON)")
    parser.add_argument("--modes", default="plain,overlap,speculative",
                        help=f"comma-separated, of {','.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        parser.error(f"--modes: {args.modes!r}: a list without repeats of {','.join(MODES)}")
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    # The ranks of a node share its cores: one torch pool each of cores / ranks threads.
    torch.set_num_threads(args.torch_threads or
                          max(1, (os.cpu_count() or 1) // facts["local_size"]))
    os.makedirs(args.swap, exist_ok=True)
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
