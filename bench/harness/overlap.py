"""backward+step of zinf.torch at stage 1: plain, reduce-only overlap and the speculative step.

    python3 bench/run.py overlap [--path DIR] [--np 2] [--layers 32] [--width 1024]
                                 [--batch 256] [--steps 5] [--rounds 2] [--clip-every-step]
                                 [--modes plain,overlap,speculative[,stage2]] [--breakdown]

--np ranks (mpirun) train a stack of --layers Linear(width, width) + Tanh layers (many
parameters, each complete at its own point of the backward pass): --steps timed steps per mode
and round after two warm-up steps, the optimizer state swapped to --path (offload_optimizer
nvme; created if missing). Every mode builds the same model (seed 0) and feeds it the same data
(seed = rank), with the same config but for the keys that make the mode; the modes' order is
rotated each round. The modes:

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

One JSON line per mode and round: the medians over the timed steps (slowest rank) of forward,
backward (loss.backward()), step (the step() call after it and zero_grad()), backward_step
(their sum), zero_grad (its part of step) and optimizer (info.optimizer_seconds: the swapped
optimizer step inside step(); in the speculative mode only what was left of it for step(), the
speculated part ran during the backward pass), the speculation counters summed over the timed
steps (speculated, speculation_committed, speculation_redone, speculation_discarded; sub-groups
of all ranks), the steps clipped, the median grad_norm, the swap MB per step and rank (all of the
step's since the previous one, and those inside the optimizer step) and the last loss (the modes
train the same model on the same data: the losses agree to rounding). Then the summary line
(last, with the machine) with the medians over the rounds, the speculation counters summed over
them, and the ratios of the medians (and, `_per_round`, of each round's):

  speculative_over_max_plain  speculative backward_step / max(plain backward, plain step)
                              (goal without --clip-every-step: <= 1.15)
  speculative_step_over_plain speculative step / plain step
  speculative_over_overlap    speculative backward_step / overlap backward_step
                              (goal with --clip-every-step: <= 1.10)
  overlap_over_plain          overlap backward_step / plain backward_step

The picture: the backward, step and backward_step seconds of each mode (medians over the rounds).

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
~ plain step_seconds. --sub-group 1048576 elements gives 17 sub-groups per rank and --bucket
4194304 elements 9 reduce buckets (4 parameters each), so that the first sub-groups' gradients
are final early in the backward pass and the speculation has work to overlap; the same sizes are
given in every mode (given keys are kept as given: the engine shapes them for the speculation
only where they are unset). --breakdown adds the engine's step line and cumulative timers
(reduce_scatter, allgather, optimizer_step) after every step, as log lines (OUT/logs/).

--clip-every-step sets gradient_clipping to 1e-6, so that every step clips (the default 1.0 is
DeepSpeed's and this model's gradient norm stays below it: clipped_steps says so per mode).

Needs the build (zinf's Python package: cmake --build --preset default --target zinf_python),
torch and numpy for /usr/bin/python3 (python3-torch), and mpirun.
"""
from pathlib import Path

from . import common, plot

HELP = "zinf.torch backward+step: plain vs reduce-only overlap vs the speculative step (mpirun)"
NAME = "overlap"
MODES = ("plain", "overlap", "speculative", "stage2")
WORKER = Path(__file__).resolve().parent / "workers" / "overlap.py"


def add_arguments(p):
    p.add_argument("--path", default="/tmp/zinf-bench-overlap-swap",
                   help="nvme_path of the swapped optimizer state, created if missing "
                        "(default %(default)s)")
    p.add_argument("--np", type=common.count(1, 1024), default=2,
                   help="ranks (mpirun -np; default %(default)s)")
    p.add_argument("--layers", type=common.count(1, 4096), default=32,
                   help="Linear + Tanh layers (default %(default)s)")
    p.add_argument("--width", type=common.count(1, 65536), default=1024,
                   help="features of each Linear (default %(default)s)")
    p.add_argument("--batch", type=common.count(1, 1_000_000), default=256,
                   help="samples per rank and step (default %(default)s)")
    p.add_argument("--steps", type=common.count(1, 1000), default=5,
                   help="timed steps per mode and round (default %(default)s)")
    p.add_argument("--rounds", type=common.count(1, 100), default=2,
                   help="rounds of every mode, order rotated (default %(default)s)")
    p.add_argument("--bucket", type=common.count(1), default=4 << 20,
                   help="zero_optimization.reduce_bucket_size in elements (default %(default)s)")
    p.add_argument("--sub-group", type=common.count(1), default=1 << 20,
                   help="zero_optimization.sub_group_size in elements (default %(default)s)")
    p.add_argument("--threads", type=common.count(0, 1024), default=0,
                   help="zinf.adam_threads (default %(default)s: the engine's choice)")
    p.add_argument("--torch-threads", type=common.count(0, 1024), default=0,
                   help="torch.set_num_threads per rank; 0: the cores / ranks on the node")
    p.add_argument("--clip-every-step", action="store_true",
                   help="gradient_clipping 1e-6: every step clips (the speculation is stepped "
                        "again in step())")
    p.add_argument("--breakdown", action="store_true",
                   help="wall_clock_breakdown: the engine logs a step line and its timers at "
                        "every step (into OUT/logs/)")
    p.add_argument("--modes", type=common.one_of(MODES, many=True),
                   default=["plain", "overlap", "speculative"],
                   help=f"comma-separated, of {','.join(MODES)} (default "
                        "plain,overlap,speculative)")


def run(args):
    path = Path(args.path).absolute()
    env = {"PYTHONPATH": common.zinf_python_path()}
    python = common.torch_python(modules=("torch", "numpy"))
    mpirun = common.mpirun(args.np, ["-x", "PYTHONPATH"])
    common.make_dir(path)
    out = common.fresh_dir(args.out, NAME)
    (out / "logs").mkdir()
    results = common.Results(out)
    cmd = mpirun + [python, WORKER, "--path", path, "--layers", args.layers,
                    "--width", args.width, "--batch", args.batch, "--steps", args.steps,
                    "--rounds", args.rounds, "--bucket", args.bucket,
                    "--sub-group", args.sub_group, "--threads", args.threads,
                    "--torch-threads", args.torch_threads, "--modes", ",".join(args.modes)]
    cmd += ["--clip-every-step"] if args.clip_every_step else []
    cmd += ["--breakdown"] if args.breakdown else []
    common.say(f"bench {NAME}", f"{len(args.modes)} modes x {args.rounds} rounds on {args.np} "
               f"ranks, swap under {path}")
    text = common.run(cmd, log=out / "logs" / "overlap.log", env=env)
    machine = common.machine()
    summary = None
    for record in common.json_lines(text, "the overlap ranks"):
        if "summary" in record:
            record["machine"] = machine
            summary = record
        results.emit(record)
    if summary is None:
        raise common.RunError(f"the ranks printed no summary line (log: {out / 'logs'})")
    draw(out / f"{NAME}.png", summary, args.modes)
    return 0


def draw(png, summary, modes):
    """Backward, step and backward_step seconds (medians over the rounds), one cluster per mode."""
    keys = (("backward", "backward"), ("step", "step()"), ("backward_step", "backward + step()"))
    series = [(label, [summary.get(f"{mode}_{key}_seconds") for mode in modes])
              for key, label in keys]
    plot.bars(png, list(modes), series, title="zinf.torch stage 1: backward and step(), "
              f"medians over {summary.get('rounds')} round(s)", ylabel="seconds")
