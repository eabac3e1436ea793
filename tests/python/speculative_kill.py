"""The speculative step and crash consistency (driven by speculative_kill_test.sh):
`mpirun -np N python3 speculative_kill.py <mode> <work dir> <stage> [checkpoint]`.

The model and config of speculative.py (sub-groups stepped during the backward pass, clipping at
some steps) at ZeRO stage 2 or 3, STEPS steps:
  reference  uninterrupted; rank 0 writes every step's weights and StepInfo to
             <work>/reference-<stage>.pt
  killed     the same loop, checking each step's weights bitwise against the reference, with
             checkpoints into <work>/ckpt-<stage> right after steps SAVE_AFTER (at least one of
             them a step that redid what it speculated: clipping applied) and one into
             <work>/mid-<stage> between step MID_SAVE's backward pass and its step() (its
             sub-groups speculated, not committed: the checkpoint holds step MID_SAVE - 1);
             at step KILL_AT, after the backward pass and a pause in which the speculation's
             writes land, the last rank writes <work>/marker-<stage>.txt and kills itself with
             SIGKILL before step()
  resume     restores [checkpoint] (a file, or a directory with `latest`) into a model built
             from another seed and trains on to STEPS: every step's weights bitwise equal to the
             reference's (the checkpoint held only committed state, and the run goes on
             exactly)."""

import os
import signal
import sys
import time

import torch

import common
import speculative
import zinf.torch

STEPS = 12
SAVE_AFTER = (5, 8)  # step 5 clips barely: it redoes what it speculated
MID_SAVE = 6
KILL_AT = 10
PAUSE = 0.5  # seconds between the killed step's backward pass and the kill


def build(cfg, stage, seed):
    return speculative.build(cfg, stage, seed=seed)


def main():
    mode, work, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    cfg = speculative.config(os.path.join(work, "swap"), world, stage=stage,
                             clip=speculative.CLIP["some"])
    ref_path = os.path.join(work, f"reference-{stage}.pt")
    reference = None if mode == "reference" else torch.load(ref_path)
    first = 1
    if mode == "resume":
        model = build(cfg, stage, seed=99)
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                       load=sys.argv[4])
        first = opt.global_step + 1
        common.check(0 < opt.global_step < STEPS, f"restored step {opt.global_step}")
        got = speculative.weights(model, stage)
        common.check(speculative.bitwise_equal(got, reference["weights"][opt.global_step - 1]),
                     f"the weights restored from {opt.resumed_from} are not the reference's "
                     f"after step {opt.global_step}")
    else:
        model = build(cfg, stage, seed=0)
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    label = f"{mode} stage {stage} on {world} rank(s)"
    counters = speculative.Counters(label)
    history = {"weights": [], "clipped": [], "speculated": [], "redone": []}
    redone_saves = 0
    for step in range(first, STEPS + 1):
        loss = speculative.local_loss(model, step, 0, 1, rank, world)
        loss.backward()
        speculative.settle(step)
        if mode == "killed" and step == MID_SAVE:
            # Mid-step: the checkpoint must hold step MID_SAVE - 1's committed state, and the
            # step then goes on with its gradient.
            path = opt.save_checkpoint(os.path.join(work, f"mid-{stage}"))
            common.check(f"step-{MID_SAVE - 1}" in os.path.basename(path),
                         f"the checkpoint saved before step {MID_SAVE} is {path}")
        if mode == "killed" and step == KILL_AT:
            time.sleep(PAUSE)
            if rank == world - 1:
                with open(os.path.join(work, f"marker-{stage}.txt"), "w") as f:
                    f.write(f"rank {rank} killed itself at step {step} after the backward pass; "
                            f"{counters.summary()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        info = opt.step(loss=loss)
        opt.zero_grad()
        counters.check(step, info)
        now = speculative.weights(model, stage)
        if reference is not None:
            common.check(speculative.bitwise_equal(now, reference["weights"][step - 1]),
                         f"{label}: the weights after step {step} differ from the "
                         "uninterrupted run's")
        history["weights"].append(now)
        history["clipped"].append(info.clipped)
        history["speculated"].append(info.speculated)
        history["redone"].append(info.speculation_redone)
        if mode == "killed" and step in SAVE_AFTER:
            opt.save_checkpoint(os.path.join(work, f"ckpt-{stage}"))
            redone_saves += info.clipped and info.speculation_redone > 0
            if step == SAVE_AFTER[-1]:
                common.check(redone_saves > 0, f"{label}: no checkpoint was saved right after a "
                             f"step that redid speculated sub-groups: {counters.summary()}")
    opt.close()
    zinf.log(f"{label}: steps {first}..{STEPS}; {counters.summary()}")
    if mode == "reference":
        common.check(counters.redone_clipped > 0 and counters.committed_unclipped > 0,
                     f"{label}: {counters.summary()}")
        if rank == 0:
            torch.save(history, ref_path)
    elif mode == "killed":
        common.check(False, f"{label}: rank {world - 1} was not killed")


if __name__ == "__main__":
    main()
