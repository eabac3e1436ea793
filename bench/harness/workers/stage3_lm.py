"""The ranks of `bench/run.py stage3-lm` (bench/harness/stage3_lm.py; its --help says what each
figure means), run by it under mpirun:

  mpirun -np 2 python3 bench/harness/workers/stage3_lm.py side-by-side --path DIR
      --bin build/bin/zinf-bench [--d-model 256] [--layers 4] [--seq 64] [--batch 8] [--steps 3]
      [--rounds 2] [--speculative-step auto|true|false]
  mpirun -np 2 python3 bench/harness/workers/stage3_lm.py bytes --path DIR --stage 3
      --offload-optimizer nvme --offload-param nvme [--d-model ...] [--layers ...] ...

The model is examples/torch/transformer_lm.py's TransformerLM (nn.Embedding, nn.TransformerEncoder
of pre-norm nn.TransformerEncoderLayer, nn.LayerNorm, a head tied to the byte embedding), built
inside zinf.torch.init at stage 3 (as it is at stages 1 and 2) with d_model / 64 heads (at least 1,
lowered until it divides d_model). The batches are random bytes from one generator seeded alike on
every rank; rank r trains on its rows of each. JSON lines on stdout (rank 0), logs on stderr.
The flags are checked by bench/run.py; here they are only parsed.
"""

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy
import torch
import torch.nn.functional as F

import zinf
import zinf.torch

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # bench/harness/workers/ -> the repository
sys.path.insert(0, os.path.join(_REPO, "examples", "torch"))
from transformer_lm import TransformerLM, parameter_count  # noqa: E402  (the example's model)

MODES = ("offload", "memory", "io")


def log(text):
    zinf.log(f"bench-stage3-lm: {text}")


def heads_for(d_model):
    heads = max(1, d_model // 64)
    while d_model % heads:
        heads -= 1
    return heads


def config_for(args, world, stage, offload_optimizer, offload_param, nvme_path):
    """A DeepSpeed config with DeepSpeed's defaults for every size (sub_group_size, buckets, the
    live window, max_in_cpu, the pool are not set: the engine chooses them)."""
    zero = {"stage": stage, "offload_optimizer": {"device": offload_optimizer}}
    if offload_optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_path
    if stage == 3:
        zero["offload_param"] = {"device": offload_param}
        if offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95],
                                                   "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }
    if args.speculative_step != "auto":
        config["zinf"] = {"speculative_step": args.speculative_step == "true"}
    return config


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def gather(values, world, call):
    """Every rank's `values` (a list of floats), as a world x len float32 array (collective)."""
    local = numpy.array(values, dtype=numpy.float32)
    everyone = numpy.empty(len(local) * world, dtype=numpy.float32)
    zinf._zinf.allgatherv(local, everyone, [len(local)] * world, call=call)
    return everyone.reshape(world, -1)


def gather_ints(values, world, call):
    """Every rank's `values` (non-negative integers below 2^44), exactly: each travels as two
    float32 halves of 22 bits (allgatherv moves float32 only). A world x len list of ints."""
    halves = []
    for v in values:
        halves += [v >> 22, v & ((1 << 22) - 1)]
    rows = gather(halves, world, call)
    return [[(int(row[2 * i]) << 22) + int(row[2 * i + 1]) for i in range(len(values))]
            for row in rows]


def store_bytes(path):
    """(allocated, apparent) bytes of the regular files under `path` (du -s -B1, du -sb)."""
    allocated = apparent = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue  # removed while walking
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


class Trainer:
    """One model and ZeroOptimizer for one config; step() runs one timed training step."""

    def __init__(self, args, facts, stage, offload_optimizer, offload_param, nvme_path,
                 metrics_path=None):
        self.rank, self.world = facts["rank"], facts["world_size"]
        self.args = args
        self.config = config_for(args, self.world, stage, offload_optimizer, offload_param,
                                 nvme_path)
        torch.manual_seed(0)
        heads = heads_for(args.d_model)
        if stage == 3:
            with zinf.torch.init(self.config):
                self.model = TransformerLM(args.d_model, args.layers, heads, args.seq)
        else:
            self.model = TransformerLM(args.d_model, args.layers, heads, args.seq)
        self.params = parameter_count(args.d_model, args.layers, args.seq)
        self.opt = zinf.torch.ZeroOptimizer(self.model.named_parameters(), config=self.config,
                                            metrics_path=metrics_path, progress=False,
                                            create_nvme_paths=True)
        self.generator = torch.Generator().manual_seed(1)
        self.rows = slice(self.rank * args.batch // self.world,
                          (self.rank + 1) * args.batch // self.world)

    def step(self):
        """(seconds of forward + backward + step on this rank, StepInfo)."""
        batch = torch.randint(0, 256, (self.args.batch, self.args.seq + 1),
                              generator=self.generator)[self.rows]
        start = time.perf_counter()
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        info = self.opt.step(loss=loss)
        self.opt.zero_grad()
        return time.perf_counter() - start, info

    def close(self):
        self.opt.close()


def run_training(args, facts, mode, nvme_path):
    """The offload or memory mode: one warm-up step, then args.steps timed ones. Returns the
    per-step seconds (slowest rank), the per-step swap bytes (all ranks) and the losses."""
    if mode == "offload":
        trainer = Trainer(args, facts, 3, "nvme", "nvme", nvme_path)
    else:
        trainer = Trainer(args, facts, 3, "cpu", "none", nvme_path)
    seconds, reads, writes, losses = [], [], [], []
    try:
        for step in range(args.steps + 1):
            local, info = trainer.step()
            slowest = float(gather([local], facts["world_size"], "bench-stage3-lm").max())
            if step == 0:
                continue  # warm-up: first gathers, allocations, files created
            seconds.append(slowest)
            reads.append(info.swap_read_bytes)
            writes.append(info.swap_write_bytes)
            losses.append(info.loss)
    finally:
        trainer.close()
    return seconds, reads, writes, losses


def run_io(args, facts, read_bytes, write_bytes, io_dir):
    """The io mode: each rank moves its share of the offload step's swap bytes with zinf-bench
    io (O_DIRECT, a fresh file in io_dir, write then read, the ranks at once). zinf-bench io
    writes and reads one size, so it moves max(read, write) per rank rounded up to 1 MiB both
    ways, and the step's I/O time is write_seconds x write / size + read_seconds x read / size
    (each op at the bandwidth it measured); the slowest rank's. Returns seconds per step."""
    world = facts["world_size"]
    mib = 1 << 20
    read_rank = math.ceil(read_bytes / world)
    write_rank = math.ceil(write_bytes / world)
    size = max(mib, math.ceil(max(read_rank, write_rank) / mib) * mib)
    gather([0], world, "bench-stage3-lm-io-start")  # the ranks start together
    out = subprocess.run([args.bin, "io", "--path", io_dir, "--size", str(size), "--op", "both",
                          "--json"], capture_output=True, text=True)
    ok = out.returncode == 0
    measured = {}
    if ok:
        for line in out.stdout.splitlines():
            record = json.loads(line)
            measured[record["op"]] = record["seconds"]
        ok = "read" in measured and "write" in measured
    if not ok:
        sys.stderr.write(out.stderr)
    local = (measured.get("write", 0.0) * write_rank / size
             + measured.get("read", 0.0) * read_rank / size) if ok else -1.0
    everyone = gather([local], world, "bench-stage3-lm-io")
    if (everyone < 0).any():
        raise SystemExit(f"bench-stage3-lm: {args.bin} io failed on some rank (above)")
    return float(everyone.max()), size


def side_by_side(args, facts):
    rank = facts["rank"]
    params = parameter_count(args.d_model, args.layers, args.seq)
    io_dir = os.path.join(args.path, "io")
    os.makedirs(io_dir, exist_ok=True)
    medians = {mode: [] for mode in MODES}
    swap = None  # (read, write) bytes of the latest offload run's median step, all ranks
    for round_ in range(args.rounds):
        order = MODES[round_ % 3:] + MODES[:round_ % 3]  # round 0 starts with offload
        this = {}
        for mode in order:
            record = {"bench": "stage3-lm", "round": round_, "mode": mode, "ranks": facts[
                "world_size"], "parameters": params, "d_model": args.d_model,
                "layers": args.layers, "seq": args.seq, "batch": args.batch}
            if mode == "io":
                if swap is None:
                    raise SystemExit("bench-stage3-lm: the io mode needs an offload run first")
                seconds, size = run_io(args, facts, swap[0], swap[1], io_dir)
                record.update(step_seconds=round(seconds, 4), read_bytes=swap[0],
                              write_bytes=swap[1], io_size_bytes_per_rank=size)
            else:
                nvme = os.path.join(args.path, f"swap-{mode}")
                seconds, reads, writes, losses = run_training(args, facts, mode, nvme)
                if mode == "offload":
                    swap = (int(statistics.median(reads)), int(statistics.median(writes)))
                seconds = statistics.median(seconds)
                record.update(step_seconds=round(seconds, 4),
                              read_bytes=int(statistics.median(reads)),
                              write_bytes=int(statistics.median(writes)),
                              loss_first=losses[0], loss_last=losses[-1])
            this[mode] = seconds
            medians[mode].append(seconds)
            if rank == 0:
                print(json.dumps(record), flush=True)
        ratio = this["offload"] / max(this["memory"], this["io"])
        if rank == 0:
            print(json.dumps({"bench": "stage3-lm-round", "round": round_, "order": list(order),
                              **{f"{m}_seconds": round(this[m], 4) for m in MODES},
                              "offload_over_max_memory_io": round(ratio, 3)}), flush=True)
            log(f"round {round_}: offload {this['offload']:.3f} s, memory {this['memory']:.3f} "
                f"s, io {this['io']:.3f} s: offload / max(memory, io) = {ratio:.2f}")
    if rank == 0:
        m = {mode: statistics.median(v) for mode, v in medians.items()}
        ratio = m["offload"] / max(m["memory"], m["io"])
        print(json.dumps({"bench": "stage3-lm-summary", "rounds": args.rounds,
                          "ranks": facts["world_size"], "parameters": params,
                          **{f"{k}_seconds": round(v, 4) for k, v in m.items()},
                          "offload_over_max_memory_io": round(ratio, 3), "goal": 1.15}),
              flush=True)
        shutil.rmtree(io_dir, ignore_errors=True)


def bytes_per_parameter(args, facts):
    """One configuration, in a process of its own: the RSS before the model, the peak, the
    engine's plan and the swap store's size after the last step (before close removes it)."""
    rank, world = facts["rank"], facts["world_size"]
    nvme = os.path.join(args.path, f"bpp-s{args.stage}-o{args.offload_optimizer}"
                        f"-p{args.offload_param}")
    metrics_dir = tempfile.TemporaryDirectory(prefix="zinf-bench-stage3-lm-")
    metrics_path = os.path.join(metrics_dir.name, "metrics.jsonl")
    before = rss_bytes()
    trainer = Trainer(args, facts, args.stage, args.offload_optimizer, args.offload_param, nvme,
                      metrics_path=metrics_path)
    losses = []
    for _ in range(args.steps):
        _, info = trainer.step()
        losses.append(info.loss)
    peak = peak_rss_bytes()
    gather([0], world, "bench-stage3-lm-store")  # every rank's last write is done
    allocated, apparent = store_bytes(nvme) if os.path.isdir(nvme) else (0, 0)
    ranks = gather_ints([before, peak], world, "bench-stage3-lm-rss")
    trainer.close()
    if rank != 0:
        return
    with open(metrics_path) as f:
        last = json.loads(f.read().splitlines()[-1])
    metrics_dir.cleanup()
    params = trainer.params
    base = [row[0] for row in ranks]
    peaks = [row[1] for row in ranks]
    added = [p - b for p, b in zip(peaks, base)]
    print(json.dumps({
        "bench": "stage3-lm-bytes", "stage": args.stage,
        "offload_optimizer": args.offload_optimizer,
        "offload_param": args.offload_param if args.stage == 3 else None,
        "ranks": world, "parameters": params, "d_model": args.d_model, "layers": args.layers,
        "steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1],
        "rss_before_model_bytes": base, "peak_rss_bytes": peaks,
        "ram_added_bytes": added,
        "ram_bytes_per_parameter": round(sum(added) / params, 3),
        "plan_bytes_per_rank": last["plan_bytes"],
        "plan_bytes_per_parameter": round(last["plan_bytes"] * world / params, 3),
        "nvme_bytes": allocated, "nvme_apparent_bytes": apparent,
        "nvme_bytes_per_parameter": round(allocated / params, 3),
    }), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("side-by-side", "bytes"):
        p = sub.add_parser(name)
        p.add_argument("--path", required=True)
        p.add_argument("--d-model", type=int, default=256)
        p.add_argument("--layers", type=int, default=4)
        p.add_argument("--seq", type=int, default=64)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--steps", type=int, default=3)
        # zinf.speculative_step: auto leaves it unset (on: stage 3 lends the gradients).
        p.add_argument("--speculative-step", choices=("auto", "true", "false"), default="auto")
        if name == "side-by-side":
            p.add_argument("--rounds", type=int, default=2)
            p.add_argument("--bin", default="build/bin/zinf-bench")
        else:
            p.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
            p.add_argument("--offload-optimizer", choices=("cpu", "nvme"), required=True)
            p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none")
    args = parser.parse_args()
    facts = zinf.init()
    if args.batch % facts["world_size"]:
        raise SystemExit(f"bench-stage3-lm: --batch {args.batch} is not a multiple of the "
                         f"{facts['world_size']} ranks")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, facts["local_size"])))
    if args.command == "side-by-side":
        side_by_side(args, facts)
    else:
        bytes_per_parameter(args, facts)


if __name__ == "__main__":
    sys.exit(main())
