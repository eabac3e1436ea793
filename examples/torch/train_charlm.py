#!/usr/bin/env python3
"""A small GPT-style byte-level language model trained with zinf.torch.ZeroOptimizer: the Adam
state (fp32 master weights, exp_avg, exp_avg_sq) of each rank's ZeRO partition lives on NVMe.

    mpirun -np 2 python3 examples/torch/train_charlm.py --steps 300
    launch/zinf-run -np 2 -- python3 examples/torch/train_charlm.py --steps 300   # as root

The text is every file under /usr/share/common-licenses (the last 5% held out). Each rank
trains on its own random windows of it; the optimizer reduces the gradients over the ranks.
Checkpoints go to --checkpoint-dir every --checkpoint-every steps and at the end (and on
SIGUSR1/SIGTERM/Ctrl-C, which stop the run after saving); --resume continues from the latest,
on any number of ranks. Only the optimizer line and the launch differ from a plain PyTorch loop.

--stage3 trains at ZeRO stage 3: the model is built inside zinf.torch.init, so each rank keeps
only its shard of every weight matrix (with --offload-param nvme, the default, not even that in
memory: the shards are read from the swap store when a module needs them), and the optimizer's
hooks gather each module's weights around its forward and backward. The loop is the same.

    mpirun -np 3 python3 examples/torch/train_charlm.py --stage3 --steps 100
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

import zinf
import zinf.torch


def config(args):
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": args.print_every,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps, "warmup_num_steps": 30,
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 2, "sub_group_size": 100_000,
                              "offload_optimizer": {"device": "nvme",
                                                    "nvme_path": args.swap_dir}},
        # The engine keeps the cadence: StepInfo.checkpoint_due every `every` steps, at
        # total_steps and on a stop signal.
        "zinf": {"checkpoint": {"dir": args.checkpoint_dir, "every": args.checkpoint_every,
                                "keep_last": 2}},
    } | (stage3(args) if args.stage3 else {})


def stage3(args):
    """The stage 3 keys: the weight matrices partitioned (the biases and LayerNorms, at most
    1000 elements, stay whole on every rank), their shards on NVMe with --offload-param nvme."""
    offload = {"device": args.offload_param}
    if args.offload_param == "nvme":
        offload.update(nvme_path=args.swap_dir, max_in_cpu=0)
    return {"zero_optimization": {"stage": 3, "sub_group_size": 100_000,
                                  "stage3_param_persistence_threshold": 1000,
                                  "offload_param": offload,
                                  "offload_optimizer": {"device": "nvme",
                                                        "nvme_path": args.swap_dir}}}


class Block(torch.nn.Module):
    def __init__(self, dim, heads, context):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 4 * dim)
        self.out = torch.nn.Linear(4 * dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(context, context)).bool())

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(torch.nn.Module):
    def __init__(self, context=64, dim=128, layers=2, heads=4):
        super().__init__()
        self.tok = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, context) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 256)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def load_text(root="/usr/share/common-licenses", limit=64 << 20):
    """Every regular file under `root` (links not followed), at most `limit` bytes in all."""
    data = bytearray()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data += f.read(max(0, limit - len(data)))
    if len(data) < 10_000:
        raise SystemExit(f"train_charlm: only {len(data)} bytes of text under {root}")
    return torch.tensor(list(data), dtype=torch.long)


def windows(text, generator, batch, context):
    starts = torch.randint(0, len(text) - context - 1, (batch,), generator=generator)
    x = torch.stack([text[s:s + context] for s in starts])
    y = torch.stack([text[s + 1:s + context + 1] for s in starts])
    return x, y


@torch.no_grad()
def held_out_loss(model, text, context, batches=8):
    g = torch.Generator().manual_seed(4242)
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = windows(text, g, 32, context)
        total += float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    model.train()
    return total / batches


@torch.no_grad()
def sample(model, context, prompt="The ", length=120, temperature=0.8, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt.encode())])
    model.eval()
    for _ in range(length):
        logits = model(idx[:, -context:])[0, -1] / temperature
        idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1, generator=g)[None]], dim=1)
    model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="last step (default 300)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--swap-dir", default="zinf-torch-demo/swap")
    parser.add_argument("--checkpoint-dir", default="zinf-torch-demo/checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="continue from the latest")
    parser.add_argument("--print-every", type=int, default=25)
    parser.add_argument("--stage3", action="store_true",
                        help="ZeRO stage 3: the model built partitioned (zinf.torch.init)")
    parser.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="nvme",
                        help="with --stage3: where each rank's weight shards live (default nvme)")
    args = parser.parse_args()

    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, facts["local_size"])))
    text = load_text()
    split = int(len(text) * 0.95)
    train_text, test_text = text[:split], text[split:]

    torch.manual_seed(0)  # the same initial weights on every rank
    if args.stage3:  # each module's parameters partitioned as soon as it is built
        with zinf.torch.init(config(args)):
            model = CharGPT(context=args.context)
    else:
        model = CharGPT(context=args.context)
    params = sum(math.prod(zinf.torch.partitioned_shape(p)) for p in model.parameters())
    zinf.log(f"model: CharGPT, {params} parameters{' (stage 3)' if args.stage3 else ''}; text "
             f"{len(text)} bytes; {world} rank(s)")

    opt = zinf.torch.ZeroOptimizer(
        model.named_parameters(), config=config(args), create_nvme_paths=True,
        total_steps=args.steps, load=args.checkpoint_dir if args.resume else None)
    first = opt.global_step + 1
    if opt.resumed_from:
        zinf.log(f"resumed at step {opt.global_step} from {opt.resumed_from}; client state "
                 f"{opt.client_state}")
    generator = torch.Generator().manual_seed(1000 * rank + first)  # each rank its own data
    start = time.monotonic()
    info = None
    for step in range(first, args.steps + 1):
        x, y = windows(train_text, generator, args.batch, args.context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        info = opt.step(loss=loss)
        opt.zero_grad()
        if info.checkpoint_due:
            opt.save_checkpoint(client_state={"step": step, "world": world})
        if step % args.checkpoint_every == 0 or step == args.steps:
            held_out = held_out_loss(model, test_text, args.context)
            zinf.log(f"step {step}: held-out loss {held_out:.4f}")
        if info.stop_requested:
            zinf.log(f"stop signal: saved step {step}, stopping")
            break
    if info is not None:
        seconds = time.monotonic() - start
        zinf.log(f"done: steps {first}..{info.step} in {seconds:.1f} s "
                 f"({seconds / max(1, info.step - first + 1):.3f} s/step), final loss "
                 f"{info.loss:.4f}")
        zinf.log("sample after \"The \":\n" + sample(model, args.context))
    opt.log_summary()
    opt.close()


if __name__ == "__main__":
    main()
