"""torch's own layers, unmodified, at ZeRO stage 3: `mpirun -np N python3 stage3_modules.py <dir>`.

Each model is built inside zinf.torch.init (its initial weights must equal torch's built the
ordinary way with the same seed, exactly) and trained with offload_param nvme (max_in_cpu 0),
clipping on, gradient accumulation 1 and 2, and must end within 1e-5 relative of
torch.optim.AdamW on the whole batches:

- lm: a transformer language model of nn.TransformerEncoderLayer (2 layers, d_model 32, 4
  heads, dropout 0) in an nn.TransformerEncoder, which deep-copies the layer it is given (the
  copies must be partitioned copies), with a causal mask and a head tied to the token embedding
  by reading it in the LM's forward (F.linear(h, self.tok.weight));
- attention: nn.MultiheadAttention alone (self-attention and cross-attention), whose forward
  reads out_proj.weight and out_proj.bias without calling out_proj, and whose __init__ zeroes
  out_proj.bias after out_proj's __init__ partitioned it;
- parent: a module whose forward uses its children's parameters directly (a Linear it never
  calls, a LayerNorm's weight through F.layer_norm, a Linear run through .forward()) and whose
  __init__ initializes a child's bias.
- transformer: nn.Transformer (one encoder and one decoder layer: nn.TransformerDecoderLayer's
  cross-attention), whose __init__ initializes every matrix through self.parameters().
- lstm: a 2-layer nn.LSTM between an embedding and a head (LSTM reads its weights through its
  _flat_weights list);
- conv: Conv2d + BatchNorm2d + ReLU twice and a head (BatchNorm over pairs of examples, the same
  pairs on every world size);
- checkpoint: blocks run through torch.utils.checkpoint, whose forward runs again in backward.
"""

import ctypes
import sys

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import common
import stage3
import zinf.torch

STEPS = 10
TOLERANCE = 1e-5
VOCAB, DIM, HEADS, TOKENS = stage3.VOCAB, 32, 4, stage3.TOKENS


class TransformerLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.randn(TOKENS, DIM) * 0.1)
        layer = torch.nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=64, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2)
        self.norm = torch.nn.LayerNorm(DIM)
        self.register_buffer("causal", torch.triu(torch.full((TOKENS, TOKENS), float("-inf")),
                                                  1))

    def forward(self, idx):
        h = self.encoder(self.tok(idx) + self.pos, mask=self.causal)
        return F.linear(self.norm(h), self.tok.weight)  # the head, tied to the embedding


def attention():
    return torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)


class Parent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, DIM)
        self.b = torch.nn.Linear(DIM, DIM)  # never called: its weight and bias read directly
        self.norm = torch.nn.LayerNorm(DIM)
        self.c = torch.nn.Linear(DIM, 4)    # run through .forward(), which runs no hooks
        torch.nn.init.normal_(self.b.bias, std=0.5)  # a child's parameter, after its __init__

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(h @ self.b.weight.t() + self.b.bias)
        h = F.layer_norm(h, (DIM,), self.norm.weight, self.norm.bias)
        return self.c.forward(h)


def transformer():
    return torch.nn.Transformer(DIM, HEADS, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=64, dropout=0.0, batch_first=True)


def transformer_loss(model, step, micro, rank=0, world=1):
    g = torch.Generator().manual_seed(3000 + 10 * step + micro)
    src = torch.randn(common.BATCH, TOKENS, DIM, generator=g)
    tgt = torch.randn(common.BATCH, 3, DIM, generator=g)
    y = torch.randn(common.BATCH, 3, DIM, generator=g)
    src, tgt, y = (common.shard(t, rank, world) for t in (src, tgt, y))
    return ((model(src, tgt) - y) ** 2).mean()


def lm_loss(model, step, micro, rank=0, world=1):
    return stage3.net_loss(model, step, micro, rank, world)


def attention_loss(model, step, micro, rank=0, world=1):
    g = torch.Generator().manual_seed(2000 + 10 * step + micro)
    x = torch.randn(common.BATCH, TOKENS, DIM, generator=g)
    memory = torch.randn(common.BATCH, 3, DIM, generator=g)
    y = torch.randn(common.BATCH, TOKENS, DIM, generator=g)
    x, memory, y = (common.shard(t, rank, world) for t in (x, memory, y))
    own, _ = model(x, x, x, need_weights=False)
    cross, _ = model(x, memory, memory)
    return ((own - y) ** 2).mean() + ((cross - y) ** 2).mean()


def parent_loss(model, step, micro, rank=0, world=1):
    return stage3.deep_loss(model, step, micro, rank, world)


class Recurrent(torch.nn.Module):
    """nn.LSTM between an embedding and a head: LSTM reads its weights through _flat_weights."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.lstm = torch.nn.LSTM(DIM, DIM, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h, _ = self.lstm(self.emb(idx))
        return self.head(h)


class Convolutional(torch.nn.Module):
    """Conv2d + BatchNorm2d + ReLU twice, pooled, then a Linear head. The convolutions have no
    bias: BatchNorm cancels it, so its gradient would be rounding noise that AdamW amplifies
    (in torch's run too), as for the attention's key bias below."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


def conv_loss(model, step, micro, rank=0, world=1):
    """BatchNorm's batch statistics are per forward call: each call sees 2 examples, so every
    world size (and torch's run on the whole batch) normalizes over the same pairs."""
    g = torch.Generator().manual_seed(4000 + 10 * step + micro)
    x = common.shard(torch.randn(common.BATCH, 3, 6, 6, generator=g), rank, world)
    y = common.shard(torch.randn(common.BATCH, 4, generator=g), rank, world)
    pairs = [((model(x[i:i + 2]) - y[i:i + 2]) ** 2).mean() for i in range(0, x.shape[0], 2)]
    return sum(pairs) / len(pairs)


class Checkpointed(torch.nn.Module):
    """Two blocks run through torch.utils.checkpoint: their forward runs again in backward."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(),
                                torch.nn.LayerNorm(DIM)) for _ in range(2))
        self.out = torch.nn.Linear(DIM, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h)
        return self.out(h)


MODELS = {"lm": (TransformerLM, lm_loss), "attention": (attention, attention_loss),
          "parent": (Parent, parent_loss), "transformer": (transformer, transformer_loss),
          "lstm": (Recurrent, lm_loss), "conv": (Convolutional, conv_loss),
          "checkpoint": (Checkpointed, parent_loss)}


def initial(make):
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in make().named_parameters()}


def comparable(weights):
    """The weights to compare with torch's: an attention's in_proj_bias without its key part.
    Softmax is invariant to a bias added to every key, so that part's gradient is zero but for
    float rounding (~1e-9, different in any other order of summation), which Adam's update
    turns into steps of the learning rate's size with that noise's sign, in torch's run too."""
    out = {}
    for n, w in weights.items():
        if n.endswith("in_proj_bias"):
            w = torch.cat([w[:DIM], w[2 * DIM:]])
        out[n] = w
    return out


def train(swap, name, accumulation):
    make, loss_of = MODELS[name]
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    cfg = stage3.config(swap, world, offload="nvme", accumulation=accumulation)
    torch.manual_seed(0)
    with zinf.torch.init(cfg):
        model = make()
    stage3.check_empty(model, f"{name}: after construction inside zinf.torch.init")
    start, expected = stage3.weights(model), initial(make)
    common.check(sorted(start) == sorted(expected), f"{name}: parameters {sorted(start)}")
    for n in start:
        common.check(torch.equal(start[n], expected[n]),
                     f"{name}: initial {n} differs from torch's built the ordinary way")

    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    for step in range(1, STEPS + 1):
        for micro in range(accumulation):
            loss = loss_of(model, step, micro, rank, world)
            loss.backward()
            stage3.check_empty(model, f"{name}: after backward {step}.{micro}")
            for n, p in model.named_parameters():
                common.check(p.grad is None, f"{name}: {n}.grad was not handed to the engine")
            if micro + 1 < accumulation:
                opt.accumulate_gradients()
        opt.step(loss=loss)
        opt.zero_grad()
        if step == 3:  # an evaluation pass between steps
            model.eval()
            with torch.no_grad():
                loss_of(model, 0, 0, rank, world)
            model.train()
            stage3.check_empty(model, f"{name}: after an evaluation pass")
    counters = opt.gather_counters()
    common.check(counters["disk_reads"] > 0, f"{name}: offload_param nvme read nothing")
    final = stage3.weights(model)
    opt.close()

    ref = stage3.reference(0, accumulation, make=make, loss_of=loss_of)
    check_trained(f"stage 3 {name}, offload_param nvme, accumulation {accumulation}, {world} "
                  "rank(s)", name, final, start, ref)


def check_trained(label, name, final, start, ref):
    """The weights `final` trained from `start` end within TOLERANCE of torch's `ref`."""
    err = stage3.max_relative_error(comparable(final), comparable(ref))
    moved = stage3.max_relative_error(final, start)
    zinf.log(f"{label}: {STEPS} steps, max relative weight error vs torch {err:.2e}")
    common.check(err < TOLERANCE, f"{name}: relative error {err:.3e} >= {TOLERANCE}")
    common.check(moved > 1e-3, f"{name}: the weights barely moved ({moved:.2e})")


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def check_shards_on_disk(swap):
    """With offload_param nvme the shards wait on disk, not in memory, until an optimizer holds
    them (and after close()): building 16 Linear(1024, 1024) (64 MiB of weights) grows the RSS
    by far less than this rank's shards, and so do gathered(modify=True) after the build (new
    values loaded) and close()."""
    # Freed blocks of 1 MiB and more go back to the system at once (glibc would keep some in
    # its heap), so that the RSS shows what is kept.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    facts = zinf.init()
    cfg = stage3.config(swap, facts["world_size"], offload="nvme")
    shards = 16 * 1024 * 1024 * 4 // facts["world_size"]
    before = rss()
    with zinf.torch.init(cfg):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    grown = rss() - before
    common.check(grown < shards // 2, f"building grew the RSS by {grown >> 20} MiB, this rank's "
                 f"shards are {shards >> 20} MiB: they are in memory")
    with zinf.torch.gathered(model.parameters(), modify=True), torch.no_grad():
        for p in model.parameters():  # loading weights, outside init
            p.mul_(0.5)
    grown = rss() - before
    common.check(grown < shards // 2, f"gathered(modify=True) grew the RSS to {grown >> 20} MiB "
                 f"over the start, this rank's shards are {shards >> 20} MiB: they are in memory")
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   create_nvme_paths=True)
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    before = rss()
    opt.close()
    grown = rss() - before
    common.check(grown < shards // 2, f"close() grew the RSS by {grown >> 20} MiB, this rank's "
                 f"shards are {shards >> 20} MiB: they came back into memory")
    stage3.check_empty(model, "after close()")
    with zinf.torch.gathered(model.parameters()):  # the shards on disk hold the weights
        common.check(all(p.abs().sum() > 0 for p in model.parameters()), "empty weights")


def main():
    swap = sys.argv[1]
    check_shards_on_disk(swap)
    names = sys.argv[2:] or list(MODELS)
    for name in names:
        for accumulation in (1, 2):
            train(swap, name, accumulation)
    zinf.log("stage3_modules: OK")


if __name__ == "__main__":
    main()
