#!/usr/bin/env python3
"""A causal transformer language model of torch's own layers, larger than the memory it is given,
trained with zinf.torch.ZeroOptimizer at ZeRO stage 3 with the weight shards and the Adam state on
NVMe (offload_param and offload_optimizer "nvme").

    mpirun -np 2 python3 examples/torch/transformer_lm.py --nvme-path /nvme/zinf --steps 4
    launch/demo-larger-than-memory.sh          # the same inside a memory cgroup (root)

The model: nn.Embedding (bytes and positions), nn.TransformerEncoderLayer (pre-norm, GELU, no
dropout) repeated by nn.TransformerEncoder with a causal mask, a final nn.LayerNorm and a head
tied to the byte embedding (F.linear(h, self.tok.weight)). It is built inside zinf.torch.init, so
no rank ever holds it whole. The config is a DeepSpeed config with DeepSpeed's defaults for the
stage-3 keys: sub_group_size, reduce_bucket_size, stage3_max_live_parameters, offload_param's
max_in_cpu and the pinned budget are not set, the engine chooses them (--config FILE uses a config
of your own instead; --explicit-sizes sets small explicit sizes, for engines that do not choose
them).

The text is every regular file under /usr/share/common-licenses (at most 4 MiB), read as bytes.
Each step draws --batch windows of --seq + 1 bytes from one generator seeded alike on every rank;
rank r trains on rows [r * batch / N, (r + 1) * batch / N) of them, so the ranks shard each batch.

Rank 0 prints one line per step (the loss, the mean over the ranks) and at the end one JSON line
(on stdout) and a human line: the parameters and fp32 weight bytes, the first and last loss, the
engine's host memory plan per rank and the budget it was held against (StepInfo's plan_bytes and
budget_bytes; the budget is the memory cgroup's limit over the node's ranks, else MemAvailable's
share), the cgroup's limit (null without one), and the peak RSS (ru_maxrss, after close()) of every rank. Each rank writes its peak to a small file beside
--nvme-path (the ranks must share that file system: one node) that rank 0 reads.
"""

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import zinf
import zinf.torch

TEXT_ROOT = "/usr/share/common-licenses"
TEXT_LIMIT_BYTES = 4 << 20


def default_config(args, world):
    """A DeepSpeed config as a DeepSpeed user writes one for stage 3 with NVMe offload: only the
    devices and paths, nothing the engine should size."""
    cfg = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path},
        },
    }
    if args.explicit_sizes:
        # Explicit small sizes (for an engine that does not yet choose unset sizes to fit the
        # host memory budget): 1M-element sub-groups and buckets, a 32 MiB pool, a 4M-element
        # live window, no shards kept in memory, the gradient partition swapped.
        zero = cfg["zero_optimization"]
        zero.update(sub_group_size=1 << 20, reduce_bucket_size=1 << 20,
                    allgather_bucket_size=1 << 20, stage3_prefetch_bucket_size=1 << 20,
                    stage3_max_live_parameters=1 << 22, stage3_max_reuse_distance=0)
        zero["offload_param"]["max_in_cpu"] = 0
        cfg["zinf"] = {"pinned_budget_bytes": 32 << 20, "swap_gradients": True}
    return cfg


class TransformerLM(torch.nn.Module):
    def __init__(self, d_model, layers, heads, seq, checkpoint_activations=False):
        super().__init__()
        self.checkpoint_activations = checkpoint_activations
        self.tok = torch.nn.Embedding(256, d_model)
        self.pos = torch.nn.Embedding(seq, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True)
        # Deep copies of the (partitioned) layer: each a partitioned layer of its own.
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = torch.nn.LayerNorm(d_model)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))
        # GPT-2's scale for the embeddings (torch's N(0, 1) would give the tied head logits of
        # about sqrt(d_model)); a child's parameter read by name here is gathered for it.
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        torch.nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t))
        mask = self.mask[:t, :t]
        if self.checkpoint_activations and torch.is_grad_enabled():
            # What nn.TransformerEncoder's forward does, each layer under torch.utils.checkpoint:
            # the backward pass keeps only each layer's input and runs the layer's forward again
            # (gathering its weights again), instead of every layer's activations at once.
            for layer in self.encoder.layers:
                h = torch.utils.checkpoint.checkpoint(layer, h, mask)
        else:
            h = self.encoder(h, mask=mask)
        return F.linear(self.ln(h), self.tok.weight)  # the head tied to the byte embedding


def parameter_count(d_model, layers, seq):
    # attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two LayerNorms 4 d
    per_layer = 12 * d_model * d_model + 13 * d_model
    return layers * per_layer + (256 + seq) * d_model + 2 * d_model


def load_text():
    """Every regular file under TEXT_ROOT (links not followed, sorted), at most TEXT_LIMIT_BYTES."""
    data = bytearray()
    for dirpath, dirnames, filenames in os.walk(TEXT_ROOT):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if len(data) >= TEXT_LIMIT_BYTES or os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data += f.read(TEXT_LIMIT_BYTES - len(data))
    if len(data) < 10_000:
        raise SystemExit(f"transformer_lm: only {len(data)} bytes of text under {TEXT_ROOT}")
    return torch.tensor(list(data), dtype=torch.long)


def cgroup_limit_bytes():
    """The memory limit of this process's cgroup (the smallest on its path; v2 memory.max or v1
    memory.limit_in_bytes), None without one: the limit the JSON line reports beside the
    engine's budget."""
    best = None
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            root, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(root, *parts[:depth], name)) as f:
                    value = f.read(64).strip()
            except OSError:
                continue
            if value != "max" and value.isdigit() and int(value) < (1 << 60):
                best = int(value) if best is None else min(best, int(value))
    return best


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=8,
                        help="sequences per step over all ranks, a multiple of the ranks")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5,
                        help="AdamW learning rate (default 1e-5: there is no warmup in a few "
                             "steps, and Adam's first steps move every weight of a wide layer "
                             "by about lr)")
    parser.add_argument("--nvme-path", default="zinf-transformer-lm/swap",
                        help="swap directory (offload_param and offload_optimizer nvme_path)")
    parser.add_argument("--config", default=None,
                        help="a DeepSpeed config JSON to use as it is (default: the example's "
                             "own, written to <nvme-path>/../transformer_lm_config.json)")
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="run each encoder layer under torch.utils.checkpoint (activation "
                             "memory of one layer instead of all)")
    parser.add_argument("--explicit-sizes", action="store_true",
                        help="explicit small stage-3 sizes instead of DeepSpeed's defaults")
    args = parser.parse_args()

    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    for name in ("d_model", "layers", "heads", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"transformer_lm: --{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads or args.batch % world:
        raise SystemExit(f"transformer_lm: --d-model {args.d_model} must be a multiple of "
                         f"--heads {args.heads}, --batch {args.batch} of the {world} ranks")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, facts["local_size"])))
    work = os.path.dirname(os.path.abspath(args.nvme_path))
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.config is None:
        config = default_config(args, world)
        config_path = os.path.join(work, "transformer_lm_config.json")
        if rank == 0:
            with open(config_path + ".tmp", "w") as f:
                json.dump(config, f, indent=2)
            os.replace(config_path + ".tmp", config_path)
    else:
        config_path = args.config
        with open(config_path) as f:
            config = json.load(f)
    text = load_text()

    params = parameter_count(args.d_model, args.layers, args.seq)
    weights_bytes = 4 * params
    zinf.log(f"transformer_lm: {params} parameters ({weights_bytes / 2**30:.2f} GiB of fp32 "
             f"weights), d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq "
             f"{args.seq}, batch {args.batch} on {world} ranks; {len(text)} bytes of text from "
             f"{TEXT_ROOT}; config {config_path}")
    torch.manual_seed(0)  # the same initial weights on every rank
    with zinf.torch.init(config):  # never whole on a rank: one module at a time
        model = TransformerLM(args.d_model, args.layers, args.heads, args.seq,
                              checkpoint_activations=args.checkpoint_activations)
    built = sum(math.prod(zinf.torch.partitioned_shape(p)) for p in model.parameters())
    assert built == params, (built, params)

    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=config,
                                   total_steps=args.steps,
                                   create_nvme_paths=True, progress=False,
                                   **({"gradient_memory_limit": 0} if args.explicit_sizes else {}))
    generator = torch.Generator().manual_seed(1)  # the same batch on every rank; each its rows
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    losses = []
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(text) - args.seq - 1, (args.batch,), generator=generator)
        window = torch.stack([text[s:s + args.seq + 1] for s in starts[rows]])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        info = opt.step(loss=loss)
        opt.zero_grad()
        losses.append(info.loss)
        zinf.log(f"step {step}/{args.steps}: loss {info.loss:.4f} ({info.step_seconds:.1f} s, "
                 f"peak RSS {info.peak_rss_bytes / 2**20:.0f} MiB)")
        if info.stop_requested:
            break
    seconds = time.monotonic() - start
    # close() (collective) gives each rank its shard of the final weights back, so the peaks are
    # read after it; each rank writes its own, and a gather of the (partitioned) embedding, a
    # collective, tells rank 0 that every rank has written.
    opt.close()
    peaks_dir = os.path.join(work, "transformer_lm_peaks")
    os.makedirs(peaks_dir, exist_ok=True)
    with open(os.path.join(peaks_dir, f"rank{rank}.tmp"), "w") as f:
        f.write(str(peak_rss_bytes()))
    os.replace(os.path.join(peaks_dir, f"rank{rank}.tmp"), os.path.join(peaks_dir, f"rank{rank}"))
    with zinf.torch.gathered(model.tok.weight):
        pass
    if rank != 0:
        return
    peaks = []
    for r in range(world):
        with open(os.path.join(peaks_dir, f"rank{r}")) as f:
            peaks.append(int(f.read()))
    limit = cgroup_limit_bytes()
    record = {
        "example": "transformer_lm", "ranks": world, "parameters": params,
        "weights_bytes": weights_bytes, "d_model": args.d_model, "layers": args.layers,
        "heads": args.heads, "seq": args.seq, "batch": args.batch, "steps": len(losses),
        "seconds": round(seconds, 1), "loss_first": losses[0], "loss_last": losses[-1],
        "losses": [round(x, 4) for x in losses], "explicit_sizes": bool(args.explicit_sizes),
        "checkpoint_activations": bool(args.checkpoint_activations),
        "plan_bytes": info.plan_bytes, "budget_bytes": info.budget_bytes or None,
        "limit_bytes": limit, "peak_rss_bytes": peaks, "peak_rss_bytes_max": max(peaks),
        "config": config_path,
    }
    print(json.dumps(record), flush=True)
    mib = 2 ** 20
    budget = "unknown" if not info.budget_bytes else f"{info.budget_bytes / mib:.0f} MiB"
    zinf.log(f"transformer_lm: {params} parameters ({weights_bytes / mib:.0f} MiB fp32) on {world} "
             f"ranks, loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps; per rank: "
             f"plan {info.plan_bytes / mib:.0f} MiB, budget {budget}, peak RSS "
             + ", ".join(f"{p / mib:.0f}" for p in peaks) + " MiB")


if __name__ == "__main__":
    sys.exit(main())
