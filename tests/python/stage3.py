"""zinf.torch at ZeRO stage 3: `mpirun -np N python3 stage3.py <scratch dir>`.

An unmodified torch model (Embedding, Linear, LayerNorm, the head's weight tied to the
embedding's) built inside zinf.torch.init is never whole on a rank, trains through the hooks of
ZeroOptimizer with offload_param none and nvme (offload_optimizer nvme), with and without
gradient accumulation, and must end within 1e-5 relative of torch.optim.AdamW on the whole
batches; its weights set with gathered(modify=True) before the optimizer are where training
starts (rank 0's win); its checkpoint restores into a stage 1 run of the same model built the
ordinary way; close() leaves each rank its shard of the final weights.

While the optimizer is open, F.linear of a partitioned weight saves the parameter, not a view
of its gathered values: after a forward pass no layer's whole weights are alive (a deeper
stack of Linear layers checks it too, also exact against AdamW), and F.linear is torch's own
again after close()."""

import gc
import os
import sys
import weakref

import torch
import torch.nn.functional as F

import common
import zinf.torch

STEPS = 10
TOLERANCE = 1e-5
VOCAB, DIM, HIDDEN, TOKENS = 40, 32, 64, 5
PERSISTENCE = 100  # elements: the biases and the LayerNorm stay whole inside the engine


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: used by two modules

    def forward(self, idx):
        x = self.ln(torch.tanh(self.fc1(self.emb(idx))))
        return self.head(self.fc2(x))


class Deep(torch.nn.Module):
    """Several Linear layers, the whole weights of each gathered only around its own use."""

    def __init__(self):
        super().__init__()
        dims = [16, HIDDEN, HIDDEN, HIDDEN, HIDDEN, 4]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.tanh(x))
        return x


def batch(step, micro):
    """The global batch of micro-batch `micro` of step `step`: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    idx = torch.randint(0, VOCAB, (common.BATCH, TOKENS), generator=g)
    return idx, torch.randint(0, VOCAB, (common.BATCH, TOKENS), generator=g)


def loss_fn(model, idx, target):
    return F.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def net_loss(model, step, micro, rank=0, world=1):
    """Net's loss on this rank's part of micro-batch `micro` of step `step`."""
    idx, target = batch(step, micro)
    return loss_fn(model, common.shard(idx, rank, world), common.shard(target, rank, world))


def deep_loss(model, step, micro, rank=0, world=1):
    x, y = common.batch(10 * step + micro)
    return common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world))


class Gathered:
    """Which gathered whole weights are still alive. A forward pre-hook on each module with
    partitioned parameters (it runs after zinf's global one, which gathered them) moves each
    parameter's values into a NumPy array of its own, equal to them, and keeps a weakref to it:
    torch.from_numpy's storage holds the array, so the weakref lives while any tensor uses
    those values, p.data or a view that autograd saved for the backward pass."""

    def __init__(self, model):
        self.refs = []  # (module name.parameter name, weakref to its gathered values)
        self.handles = []
        for prefix, module in model.named_modules():
            if any(zinf.torch.is_partitioned(p) for p in module._parameters.values()
                   if p is not None):
                self.handles.append(module.register_forward_pre_hook(self.hook(prefix)))

    def hook(self, prefix):
        def pre_forward(module, inputs):
            for name, p in module._parameters.items():
                if p is None or not zinf.torch.is_partitioned(p):
                    continue
                shape = zinf.torch.partitioned_shape(p)
                common.check(tuple(p.shape) == shape,
                             f"{prefix}.{name} is {tuple(p.shape)} in its forward, not {shape}")
                values = p.detach().numpy().copy()
                p.data = torch.from_numpy(values)
                self.refs.append((f"{prefix}.{name}", weakref.ref(values)))
        return pre_forward

    def check_released(self, when):
        gc.collect()
        alive = [name for name, ref in self.refs if ref() is not None]
        common.check(not alive, f"the gathered whole weights of {alive} are alive {when}")
        self.refs.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def config(swap, world, stage=3, offload="none", accumulation=1):
    cfg = common.config(swap, world=world)
    cfg["gradient_accumulation_steps"] = accumulation
    zero = cfg["zero_optimization"]
    zero["stage"] = stage
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE
        zero["offload_param"] = {"device": offload}
        if offload == "nvme":  # nothing in memory: every gathered shard is read from the store
            zero["offload_param"].update(nvme_path=swap, max_in_cpu=0)
    return cfg


def build(cfg, seed):
    torch.manual_seed(seed)
    with zinf.torch.init(cfg):
        model = Net()
    return model


def weights(model):
    with zinf.torch.gathered(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_relative_error(a, b):
    """The largest over a's parameters of ||a - b|| / ||b||."""
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in a)


def check_empty(model, when):
    for n, p in model.named_parameters():
        common.check(zinf.torch.is_partitioned(p), f"{n} is not partitioned ({when})")
        common.check(p.numel() == 0, f"{n} holds {p.numel()} elements {when}")


def reference(seed, accumulation, start=None, make=Net, loss_of=net_loss):
    """torch.optim.AdamW over the whole batches, the same clipping and warmup."""
    torch.manual_seed(seed)
    model = make()
    if start is not None:
        model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.05)
    for step in range(1, STEPS + 1):
        for micro in range(accumulation):
            (loss_of(model, step, micro) / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for group in opt.param_groups:
            group["lr"] = common.warmup_lr(step)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(swap, offload, accumulation, modify=False):
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    cfg = config(swap, world, offload=offload, accumulation=accumulation)
    model = build(cfg, seed=0)
    check_empty(model, "after construction inside zinf.torch.init")
    shapes = {n: zinf.torch.partitioned_shape(p) for n, p in model.named_parameters()}
    common.check(shapes["emb.weight"] == (VOCAB, DIM), f"partitioned_shape {shapes}")
    start = None
    if modify:
        # Rank 0's values win: the other ranks load zeros.
        torch.manual_seed(7)
        start = Net().state_dict()
        mine = start if rank == 0 else {k: torch.zeros_like(v) for k, v in start.items()}
        with zinf.torch.gathered(model.parameters(), modify=True):
            model.load_state_dict(mine)
        check_empty(model, "after gathered(modify=True)")
        err = max_relative_error(weights(model), start)
        common.check(err == 0, f"gathered(modify=True): weights differ from rank 0's by {err}")

    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    common.check(opt.num_partitioned_params == 3,
                 f"{opt.num_partitioned_params} parameters partitioned, expected the 3 weights")
    try:
        with zinf.torch.gathered(model.parameters(), modify=True):
            pass
        common.check(False, "gathered(modify=True) after the optimizer did not raise")
    except ValueError as e:
        common.check("master weights" in str(e), f"unexpected message: {e}")
    check_empty(model, "after a refused gathered(modify=True)")

    gathered = Gathered(model)
    for step in range(1, STEPS + 1):
        for micro in range(accumulation):
            loss = net_loss(model, step, micro, rank, world)
            gathered.check_released(f"after forward {step}.{micro} (held for the backward pass)")
            loss.backward()
            gathered.check_released(f"after backward {step}.{micro}")
            check_empty(model, f"after backward {step}.{micro}")
            for n, p in model.named_parameters():
                common.check(p.grad is None, f"{n}.grad was not handed to the engine")
            if micro + 1 < accumulation:
                opt.accumulate_gradients()
        info = opt.step(loss=loss)
        opt.zero_grad()
        common.check(info.step == step, f"StepInfo.step {info.step} != {step}")
        if step == 3:  # an evaluation forward pass (no gradient) between steps
            with torch.no_grad():
                loss_fn(model, *batch(0, 0))
            check_empty(model, "after a no_grad forward")
    counters = opt.gather_counters()
    common.check(counters["calls"] > 0 and counters["gathered"] > 0, f"counters {counters}")
    if offload == "nvme":
        common.check(counters["disk_reads"] > 0, f"offload_param nvme read no shard: {counters}")
    final = weights(model)
    ckpt = opt.save_checkpoint(os.path.join(swap, f"ckpt-{offload}-{accumulation}"))
    opt.close()
    gathered.remove()
    # close() gives each rank its shard of the final weights back.
    check_empty(model, "after close()")
    after = weights(model)
    err = max_relative_error(after, final)
    common.check(err == 0, f"weights after close() differ by {err}")

    ref = reference(0, accumulation, start)
    err = max_relative_error(final, ref)
    moved = max_relative_error(final, start or _initial())
    zinf.log(f"stage 3, offload_param {offload}, accumulation {accumulation}"
             f"{', modify' if modify else ''}, {world} rank(s): {STEPS} steps, max relative "
             f"weight error vs torch {err:.2e}; gathers {counters}")
    common.check(err < TOLERANCE, f"relative error {err:.3e} >= {TOLERANCE}")
    common.check(moved > 1e-3, f"the weights barely moved ({moved:.2e})")
    return final, ckpt


def train_deep(swap):
    """A stack of Linear layers: after each forward pass none of their gathered weights is
    alive (F.linear would keep each in the view of it that it saves for the backward pass),
    F.linear is zinf's only while the optimizer is open, and training is exact."""
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    original = F.linear
    cfg = config(swap, world)
    torch.manual_seed(0)
    with zinf.torch.init(cfg):
        model = Deep()
    start = weights(model)
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    common.check(opt.num_partitioned_params == len(model.layers),
                 f"{opt.num_partitioned_params} parameters partitioned, expected the weights")
    common.check(F.linear is not original, "F.linear is torch's own with the optimizer open")
    gathered = Gathered(model)
    for step in range(1, STEPS + 1):
        loss = deep_loss(model, step, 0, rank, world)
        gathered.check_released(f"after forward {step}")
        loss.backward()
        gathered.check_released(f"after backward {step}")
        opt.step(loss=loss)
    final = weights(model)
    opt.close()
    gathered.remove()
    common.check(F.linear is original, "F.linear was not restored by close()")
    err = max_relative_error(final, reference(0, 1, start, make=Deep, loss_of=deep_loss))
    zinf.log(f"stage 3, {len(model.layers)} Linear layers, {world} rank(s): no gathered weights "
             f"alive after forward; max relative weight error vs torch {err:.2e}")
    common.check(err < TOLERANCE, f"relative error {err:.3e} >= {TOLERANCE}")


def check_linear_function():
    """zinf's F.linear for partitioned weights has F.linear's gradients: 1-D, 2-D and 3-D
    inputs, with and without a bias (float64, on plain tensors)."""
    g = torch.Generator().manual_seed(3)
    for shape in [(5,), (4, 5), (2, 3, 5)]:
        for with_bias in (True, False):
            tensors = [torch.randn(shape, generator=g, dtype=torch.float64),
                       torch.randn(7, 5, generator=g, dtype=torch.float64),
                       torch.randn(7, generator=g, dtype=torch.float64) if with_bias else None]
            grad = torch.randn(shape[:-1] + (7,), generator=g, dtype=torch.float64)
            results = []
            for linear in (F.linear, zinf.torch._PartitionedLinear.apply):
                leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
                out = linear(*leaves)
                out.backward(grad)
                results.append([out] + [None if t is None else t.grad for t in leaves])
            for a, b in zip(*results):
                common.check((a is None) == (b is None) and (a is None or torch.allclose(a, b)),
                             f"linear of a {shape} input (bias {with_bias}) differs: {a} {b}")


def _initial():
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in Net().named_parameters()}


def restore_at_stage1(swap, ckpt, expected):
    """The stage 3 checkpoint into an ordinary (whole, stage 1) model and optimizer."""
    world = zinf.init()["world_size"]
    torch.manual_seed(5)
    model = Net()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config(swap, world, stage=1),
                                   load=ckpt, progress=False)
    common.check(opt.global_step == STEPS, f"restored step {opt.global_step}")
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    err = max_relative_error(got, expected)
    common.check(err == 0, f"stage 1 restore of a stage 3 checkpoint differs by {err}")
    # And it trains on.
    idx, target = batch(STEPS + 1, 0)
    rank = opt.rank
    loss_fn(model, common.shard(idx, rank, world), common.shard(target, rank, world)).backward()
    opt.step()
    opt.close()


def main():
    swap = sys.argv[1]
    check_linear_function()
    train_deep(swap)
    final, ckpt = train(swap, "none", 1)
    restore_at_stage1(swap, ckpt, final)
    train(swap, "nvme", 2)
    train(swap, "none", 2, modify=True)
    zinf.log("stage3: OK")


if __name__ == "__main__":
    main()
