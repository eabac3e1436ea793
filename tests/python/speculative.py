"""The speculative optimizer step (engine.h, "Speculative step"; zinf.speculative_step):
`mpirun -np N python3 speculative.py <work dir>`.

A stack of Linear(64, 64) layers with sub-groups and reduce buckets of 8192 elements (several of
each per rank, so that sub-groups complete while the backward pass goes on and are stepped ahead
of step()). Every case checks StepInfo's counters at every step: an applied step without clipping
commits all it speculated, a clipped one redoes all of it, a skipped (fp16 overflow) one drops
all of it; and every case asserts that something was speculated (and committed, redone or
dropped where it must be), so that none passes without speculating. (A rank stops speculating
once the sub-groups it has seen prove that the step clips: a step clipped far below its norm
speculates nothing, one that clips barely speculates and redoes.)

- exact: stages 2 and 3 against torch.optim.AdamW on the whole batches (within 1e-5 relative),
  clipping at no step, at every step and at some steps (those with accumulation 2 at stage 3,
  and with offload_param nvme: the weight shards read back from the swap store);
- dropped: a backward pass that zero_grad() drops (stage 2) drops what it speculated;
- fp16: fp16 parameters with dynamic loss scaling at stage 2, overflows injected on one rank
  (as fp16.py) at some steps: those are skipped with the weights unchanged and the loss scale as
  DeepSpeed's, and the run ends bitwise equal to the same run with speculative_step false;
- groups: two parameter groups (their own lr and weight_decay) under the config's WarmupLR with
  accumulation 2, and under torch's LambdaLR (which changes the lr between steps: a step whose
  lr changed may redo what it speculated, one whose lr did not commits it), against AdamW;
- host: zinf.host_cache_bytes holding some sub-groups in memory: exact against AdamW, and fewer
  bytes read from the store than without the tier;
- q8: zinf.optimizer_state q8 at stage 3 with clipping at some steps and accumulation 2,
  bitwise equal to the same run with speculative_step false (which speculates nothing);
- stage1: stage 1 with overlap_backward=True and speculative_step true, exact against AdamW;
  without the key, stage 1 speculates nothing.

After each last backward pass the loop sleeps SETTLE seconds so that the engine's threads
(reductions, then the speculation) reach the sub-groups completed during the pass even on a
loaded machine (longer before step REDONE_STEP, whose redo the runs with clipping at some steps
assert); the results may not depend on it (what is not speculated, step() steps)."""

import os
import sys
import time

import torch

import common
import fp16 as fp16_test
import stage3
import zinf.torch

STEPS = 10
TOLERANCE = 1e-5
WIDTH, DEPTH = 64, 8  # 8 Linear layers, about 30k elements
SUB_GROUP = 8192
BUCKET = 8192
SETTLE = 0.1
REDONE_STEP = 5  # the one step that clips barely ("some" clipping): a longer pause before it


def settle(step):
    """The pause between a step's last backward pass and step()."""
    time.sleep(5 * SETTLE if step == REDONE_STEP else SETTLE)
# gradient_clipping: below every gradient norm of these runs, above all of them, and between:
# the first 4 steps' norms are below 0.3, step 5's 0.47 (runs that must clip at some steps and
# not at others, and redo speculated sub-groups at a clipped step, check that they did).
CLIP = {"none": 1000.0, "every": 1e-3, "some": 0.45}
LAMBDA_CLIP = 0.8  # the LambdaLR run's: it clips at some of its steps at the full lr
LR = 0.02


class Deep(torch.nn.Module):
    """DEPTH Linear layers with tanh between them; `dtype` parameters computed in float32
    (torch 1.13 has no fp16 matmul on the CPU)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        dims = [16] + [WIDTH] * (DEPTH - 1) + [4]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.dtype = dtype
        if dtype != torch.float32:
            self.layers.to(dtype)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i:
                x = torch.tanh(x)
            if self.dtype == torch.float32:
                x = layer(x)
            else:
                x = torch.nn.functional.linear(x, layer.weight.float(), layer.bias.float())
        return x


def make(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Deep(dtype)


def micro_batch(step, micro, accumulation):
    """Micro-batch `micro` of step `step`'s global batch (the same on every rank)."""
    x, y = fp16_test.batch(step)  # a learnable target: the loss falls
    n = x.shape[0] // accumulation
    return x[micro * n:(micro + 1) * n], y[micro * n:(micro + 1) * n]


def local_loss(model, step, micro, accumulation, rank, world):
    x, y = micro_batch(step, micro, accumulation)
    return common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world))


def config(swap, world, stage=2, clip=CLIP["none"], accumulation=1, speculative=None,
           offload="none", **zinf_keys):
    cfg = stage3.config(swap, world, stage=stage, offload=offload, accumulation=accumulation)
    cfg["train_micro_batch_size_per_gpu"] = common.BATCH // (world * accumulation)
    cfg["gradient_clipping"] = clip
    zero = cfg["zero_optimization"]
    zero["sub_group_size"] = SUB_GROUP
    zero["reduce_bucket_size"] = BUCKET
    keys = dict(zinf_keys)
    if speculative is not None:
        keys["speculative_step"] = speculative
    if keys:
        cfg["zinf"] = keys
    os.makedirs(swap, exist_ok=True)
    return cfg


def weights(model, stage):
    if stage == 3:
        return stage3.weights(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_relative_error(a, b):
    return max(float((a[n].float() - b[n].float()).norm() / b[n].float().norm()) for n in a)


def bitwise_equal(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


class Counters:
    """StepInfo's speculation counters, checked at every step and summed."""

    def __init__(self, label):
        self.label = label
        self.speculated = self.committed = self.redone = self.discarded = 0
        self.clipped = self.unclipped = self.skipped = 0
        self.committed_unclipped = self.redone_clipped = 0
        self.last_clipped = False  # the last applied step clipped

    def check(self, step, info, hyper_changed=False):
        s, c = info.speculated, info.speculation_committed
        r, d = info.speculation_redone, info.speculation_discarded
        where = (f"{self.label}: step {step} (clipped {info.clipped}, skipped {info.skipped}): "
                 f"speculated {s}, committed {c}, redone {r}, discarded {d}")
        if self.last_clipped:
            common.check(s == 0, f"{where}: the step after a clipped one speculates nothing")
        if not info.skipped:
            self.last_clipped = info.clipped
        if info.skipped:
            common.check(d == s and c == 0 and r == 0, f"{where}: a skipped step drops all")
            self.skipped += 1
        elif info.clipped:
            common.check(r == s and c == 0 and d == 0, f"{where}: a clipped step redoes all")
            self.clipped += 1
            self.redone_clipped += r
        elif hyper_changed:
            # The lr was handed to the engine after the speculation assumed the previous one.
            common.check(c + r == s and d == 0, f"{where}: commits or redoes all")
        else:
            common.check(c == s and r == 0 and d == 0, f"{where}: an unclipped step commits all")
            self.unclipped += 1
            self.committed_unclipped += c
        self.speculated += s
        self.committed += c
        self.redone += r
        self.discarded += d

    def summary(self):
        return (f"speculated {self.speculated}, committed {self.committed}, redone "
                f"{self.redone}, discarded {self.discarded} over {self.clipped} clipped, "
                f"{self.unclipped} unclipped and {self.skipped} skipped steps")


def reference(stage_seed, clip, accumulation, groups=None, lr_at=None, start=None):
    """torch.optim.AdamW over the whole batches: the config's clipping and WarmupLR (or `lr_at`:
    step -> the lr of each group), `groups` (model -> param groups) or one group."""
    model = make(stage_seed)
    if start is not None:
        model.load_state_dict(start)
    params = groups(model) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    base = [g["lr"] for g in opt.param_groups]
    for step in range(1, STEPS + 1):
        for micro in range(accumulation):
            (common.loss_fn(model, *micro_batch(step, micro, accumulation)) /
             accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for i, group in enumerate(opt.param_groups):
            group["lr"] = lr_at(step)[i] if lr_at else common.warmup_lr(step, base[i])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model, opt, counters, stage, accumulation=1, after_backward=None, hyper_changed=None,
          before_step=None):
    """STEPS steps; returns the StepInfos. `after_backward(step)` runs after each step's last
    backward pass, `hyper_changed(step)` says whether the lr differs from the previous step's."""
    rank, world = opt.rank, opt.world_size
    infos = []
    for step in range(1, STEPS + 1):
        if before_step:
            before_step(step)
        for micro in range(accumulation):
            loss = local_loss(model, step, micro, accumulation, rank, world)
            loss.backward()
            if micro + 1 < accumulation:
                opt.accumulate_gradients()
        if after_backward:
            after_backward(step)
        settle(step)
        info = opt.step(loss=loss)
        opt.zero_grad()
        common.check(info.step == step, f"StepInfo.step {info.step} != {step}")
        counters.check(step, info, hyper_changed(step) if hyper_changed else False)
        infos.append(info)
    return infos


def build(cfg, stage, seed=0, dtype=torch.float32):
    if stage == 3:
        torch.manual_seed(seed)
        with zinf.torch.init(cfg):
            model = Deep(dtype)
        return model
    return make(seed, dtype)


def exact(work, world, stage, clip_name, accumulation=1, offload="none"):
    label = (f"exact stage {stage}, clipping at {clip_name} step(s), accumulation {accumulation}"
             f"{', offload_param nvme' if offload == 'nvme' else ''}")
    cfg = config(os.path.join(work, "swap"), world, stage=stage, clip=CLIP[clip_name],
                 accumulation=accumulation, offload=offload)
    model = build(cfg, stage)
    start = weights(model, stage)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    counters = Counters(label)
    train(model, opt, counters, stage, accumulation)
    final = weights(model, stage)
    opt.close()
    err = max_relative_error(final, reference(0, CLIP[clip_name], accumulation, start=start))
    moved = max_relative_error(final, start)
    zinf.log(f"{label} on {world} rank(s): max relative error vs torch {err:.2e}; "
             f"{counters.summary()}")
    common.check(err < TOLERANCE, f"{label}: relative error {err:.3e} >= {TOLERANCE}")
    common.check(moved > 1e-3, f"{label}: the weights barely moved ({moved:.2e})")
    if clip_name == "none":
        common.check(counters.clipped == 0, f"{label}: {counters.clipped} steps clipped")
        common.check(counters.speculated > 0, f"{label}: nothing was speculated")
    elif clip_name == "every":
        # Far below every norm: the first sub-group a rank sees proves that the step clips, and
        # the speculation stops there (engine.h: nothing more is speculated).
        common.check(counters.unclipped == 0, f"{label}: {counters.unclipped} steps unclipped")
        common.check(counters.speculated == 0, f"{label}: speculated although every sub-group "
                     f"proves the clipping: {counters.summary()}")
    else:
        # Step 5 clips barely (its norm 0.47): the sub-groups seen before it ends do not prove
        # it, so they are speculated and redone; later steps stop the speculation early.
        common.check(counters.redone_clipped > 0 and counters.committed_unclipped > 0,
                     f"{label}: the run must commit at unclipped steps and redo at clipped ones: "
                     f"{counters.summary()}")


def fp16(work, world):
    """fp16.py's dynamic loss scaling with overflows injected during the backward pass: the
    speculation of an overflowing step is dropped. The same run with speculative_step false is
    the reference (bitwise)."""
    overflows = {3, 6, 7}
    scaling = dict(fp16_test.FP16)
    rank = zinf.init()["rank"]
    results = {}
    for speculative in (True, False):
        label = f"fp16 (speculative_step {speculative})"
        cfg = config(os.path.join(work, "swap"), world, stage=2, speculative=speculative)
        cfg["fp16"] = scaling
        model = make(0, torch.float16)
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
        ref = fp16_test.Reference(scaling)
        counters = Counters(label)
        for step in range(1, STEPS + 1):
            common.check(opt.loss_scale == ref.scale,
                         f"{label}: step {step}: loss_scale {opt.loss_scale} != {ref.scale}")
            loss = local_loss(model, step, 0, 1, rank, world)
            overflow = step in overflows
            hook = None
            if overflow and rank == step % world:
                # A middle layer: the sub-groups of the last layers (whose gradients come first
                # in the backward pass) are speculated before the Inf reaches a rank, the Inf's
                # sub-groups then stop the speculation.
                def poison(grad):
                    return torch.full_like(grad, float("inf"))
                hook = model.layers[DEPTH // 2].weight.register_hook(poison)
            opt.backward(loss)
            if hook is not None:
                hook.remove()
            settle(step)
            before = weights(model, 2)
            info = opt.step(loss=loss)
            ref.update(overflow)
            common.check(info.skipped == overflow,
                         f"{label}: step {step}: skipped {info.skipped}, overflow {overflow}")
            common.check(info.next_loss_scale == ref.scale,
                         f"{label}: step {step}: next_loss_scale {info.next_loss_scale} != "
                         f"{ref.scale}")
            after = weights(model, 2)
            for n, p in after.items():
                common.check(p.dtype == torch.float16 and bool(torch.isfinite(p).all()),
                             f"{label}: step {step}: {n} is {p.dtype}, finite "
                             f"{bool(torch.isfinite(p).all())}")
            if overflow:
                common.check(bitwise_equal(before, after),
                             f"{label}: step {step}: a skipped step changed the weights")
            counters.check(step, info)
        results[speculative] = weights(model, 2)
        opt.close()
        zinf.log(f"{label} on {world} rank(s): {counters.summary()}")
        if speculative:
            common.check(counters.discarded > 0 and counters.committed > 0,
                         f"{label}: overflowing steps must drop speculated sub-groups and clean "
                         f"ones commit them: {counters.summary()}")
        else:
            common.check(counters.speculated == 0, f"{label}: {counters.summary()}")
    common.check(bitwise_equal(results[True], results[False]),
                 "fp16: the speculative run's weights differ from those without speculation")
    moved = max_relative_error(results[True], weights(make(0, torch.float16), 2))
    common.check(moved > 1e-3, f"fp16: the weights barely moved ({moved:.2e})")


def dropped(work, world):
    """zero_grad() after a finished backward pass drops its gradients (stage 2 lends them): what
    was speculated during that pass is dropped too, and the step takes the next pass's."""
    label = "stage 2, a backward pass dropped by zero_grad()"
    cfg = config(os.path.join(work, "swap"), world, stage=2)
    model = make()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    counters = Counters(label)

    def drop_a_pass(step):
        if step in (4, 7):
            # Another batch's pass first, speculated; zero_grad() drops it, its speculation with
            # it (else step() would commit that: the step's own pass finds its sub-groups
            # speculated already).
            local_loss(model, 100 + step, 0, 1, opt.rank, world).backward()
            time.sleep(SETTLE)
            opt.zero_grad()

    train(model, opt, counters, 2, before_step=drop_a_pass)
    final = weights(model, 2)
    opt.close()
    err = max_relative_error(final, reference(0, CLIP["none"], 1))
    zinf.log(f"{label} on {world} rank(s): max relative error vs torch {err:.2e}; "
             f"{counters.summary()}")
    common.check(err < TOLERANCE, f"{label}: relative error {err:.3e} >= {TOLERANCE}")
    common.check(counters.committed > 0, f"{label}: nothing committed: {counters.summary()}")


SPLIT = 6  # the first 3 layers' parameters are group 0, the rest group 1


def groups_of(model, named=True):
    params = list(model.named_parameters())
    if not named:
        params = [p for _, p in params]
    return [{"params": params[:SPLIT], "weight_decay": 0.1},
            {"params": params[SPLIT:], "weight_decay": 0.0, "lr": LR / 2}]


def groups(work, world):
    """Two groups: the config's WarmupLR (each group warms up to its own lr) with DeepSpeed's
    accumulation, and torch's LambdaLR."""
    # WarmupLR without warmup_max_lr, from the config.
    accumulation = 2
    label = "groups, the config's WarmupLR, accumulation 2"
    cfg = config(os.path.join(work, "swap"), world, stage=2, accumulation=accumulation)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                       "warmup_num_steps": 5,
                                                       "warmup_type": "linear"}}
    cfg["optimizer"]["params"]["lr"] = LR
    model = make()
    opt = zinf.torch.ZeroOptimizer(groups_of(model), config=cfg, progress=False)
    counters = Counters(label)
    train(model, opt, counters, 2, accumulation)
    final = weights(model, 2)
    opt.close()
    ref = reference(0, CLIP["none"], accumulation, groups=lambda m: groups_of(m, named=False),
                    lr_at=lambda step: [common.warmup_lr(step, LR), common.warmup_lr(step, LR / 2)])
    err = max_relative_error(final, ref)
    zinf.log(f"{label} on {world} rank(s): max relative error vs torch {err:.2e}; "
             f"{counters.summary()}")
    common.check(err < TOLERANCE, f"{label}: relative error {err:.3e} >= {TOLERANCE}")
    common.check(counters.committed > 0, f"{label}: nothing committed: {counters.summary()}")

    # torch's LambdaLR: the lr of step k is set after step k - 1: 0 at step 1 (as WarmupLR: a
    # first Adam step moves every element by about lr, whatever its gradient, so that rounding
    # in the gradient's sum would show), constant from step 6 on.
    label = "groups, torch's LambdaLR"
    cfg = config(os.path.join(work, "swap"), world, stage=2, clip=LAMBDA_CLIP)
    del cfg["scheduler"]
    model = make()
    opt = zinf.torch.ZeroOptimizer(groups_of(model), config=cfg, progress=False)

    def factor(i):
        return min(1.0, i / 4)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    counters = Counters(label)
    rank = opt.rank
    for step in range(1, STEPS + 1):
        loss = local_loss(model, step, 0, 1, rank, world)
        loss.backward()
        settle(step)
        info = opt.step(loss=loss)
        opt.zero_grad()
        # The engine held step - 1's lr (the base lr before step 1) when the pass began.
        previous = factor(step - 2) if step > 1 else 1.0
        counters.check(step, info, hyper_changed=factor(step - 1) != previous)
        sched.step()
    final = weights(model, 2)
    opt.close()
    ref = reference(0, LAMBDA_CLIP, 1, groups=lambda m: groups_of(m, named=False),
                    lr_at=lambda step: [LR * factor(step - 1), LR / 2 * factor(step - 1)])
    err = max_relative_error(final, ref)
    zinf.log(f"{label} on {world} rank(s): max relative error vs torch {err:.2e}; "
             f"{counters.summary()}")
    common.check(err < TOLERANCE, f"{label}: relative error {err:.3e} >= {TOLERANCE}")
    # zinf.torch hands the lr the scheduler set to the engine when the pass begins, so the steps
    # whose lr changed commit too; a step after a clipped one speculates nothing.
    common.check(counters.committed > 0 and counters.redone_clipped > 0,
                 f"{label}: {counters.summary()}")


def host(work, world):
    """A host tier of about one sub-group's state per rank: those stay in memory, the rest is
    speculated; exact, and fewer bytes read from the store than without the tier."""
    read = {}
    for cache in (0, 12 * SUB_GROUP + 4096):
        label = f"host tier of {cache} bytes"
        cfg = config(os.path.join(work, "swap"), world, stage=2, clip=CLIP["some"],
                     host_cache_bytes=cache)
        model = make()
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
        counters = Counters(label)
        infos = train(model, opt, counters, 2)
        final = weights(model, 2)
        opt.close()
        read[cache] = sum(i.swap_read_bytes for i in infos)
        err = max_relative_error(final, reference(0, CLIP["some"], 1))
        zinf.log(f"{label} on {world} rank(s): {read[cache]} bytes read, max relative error vs "
                 f"torch {err:.2e}; {counters.summary()}")
        common.check(err < TOLERANCE, f"{label}: relative error {err:.3e} >= {TOLERANCE}")
        common.check(counters.speculated > 0, f"{label}: nothing was speculated")
        common.check(counters.committed_unclipped > 0 and counters.redone_clipped > 0,
                     f"{label}: {counters.summary()}")
    common.check(0 < read[max(read)] < read[0],
                 f"host: the tier read {read[max(read)]} bytes, without it {read[0]}")


def q8(work, world):
    """q8 state at stage 3: the speculative run bitwise equal to one without speculation."""
    results = {}
    for speculative in (True, False):
        label = f"q8 stage 3 (speculative_step {speculative}), clipping at some steps"
        cfg = config(os.path.join(work, "swap"), world, stage=3, clip=CLIP["some"],
                     accumulation=2, speculative=speculative, optimizer_state="q8")
        model = build(cfg, 3)
        start = weights(model, 3)
        opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
        counters = Counters(label)
        train(model, opt, counters, 3, accumulation=2)
        results[speculative] = weights(model, 3)
        opt.close()
        zinf.log(f"{label} on {world} rank(s): {counters.summary()}")
        if speculative:
            common.check(counters.committed_unclipped > 0 and counters.redone_clipped > 0,
                         f"{label}: {counters.summary()}")
        else:
            common.check(counters.speculated == 0, f"{label}: {counters.summary()}")
    diff = [n for n in results[True] if not torch.equal(results[True][n], results[False][n])]
    common.check(not diff, f"q8: speculative and plain runs differ in {diff}")
    moved = max_relative_error(results[True], start)
    common.check(moved > 1e-3, f"q8: the weights barely moved ({moved:.2e})")


def stage1(work, world):
    """Stage 1: speculation needs the gradients handed per parameter (overlap_backward) and the
    key set; without the key it is off."""
    label = "stage 1 with overlap_backward and speculative_step true"
    cfg = config(os.path.join(work, "swap"), world, stage=1, clip=CLIP["some"], speculative=True)
    model = make()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   overlap_backward=True)
    counters = Counters(label)
    train(model, opt, counters, 1)
    final = weights(model, 1)
    opt.close()
    err = max_relative_error(final, reference(0, CLIP["some"], 1))
    zinf.log(f"{label} on {world} rank(s): max relative error vs torch {err:.2e}; "
             f"{counters.summary()}")
    common.check(err < TOLERANCE, f"{label}: relative error {err:.3e} >= {TOLERANCE}")
    common.check(counters.committed_unclipped > 0 and counters.redone_clipped > 0,
                 f"{label}: {counters.summary()}")

    label = "stage 1 with overlap_backward, speculative_step unset"
    cfg = config(os.path.join(work, "swap"), world, stage=1)
    model = make()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   overlap_backward=True)
    rank = opt.rank
    for step in range(1, 4):
        local_loss(model, step, 0, 1, rank, world).backward()
        time.sleep(SETTLE)
        info = opt.step()
        opt.zero_grad()
        common.check(info.speculated == 0, f"{label}: step {step} speculated {info.speculated}")
    opt.close()


def main():
    work = sys.argv[1]
    facts = zinf.init()
    world = facts["world_size"]
    for stage in (2, 3):
        for clip_name in ("none", "every", "some"):
            exact(work, world, stage, clip_name)
    exact(work, world, 3, "some", accumulation=2)
    exact(work, world, 3, "none", offload="nvme")
    exact(work, world, 3, "some", offload="nvme")
    dropped(work, world)
    fp16(work, world)
    groups(work, world)
    host(work, world)
    q8(work, world)
    stage1(work, world)
    zinf.log("speculative: OK")


if __name__ == "__main__":
    main()
