"""A DeepSpeed user's config handed to zinf.torch as it is: `mpirun -np 2 python3
deepspeed_config.py <work dir>`. The example config of DeepSpeed's config reference
(tests/config/deepspeed_configs/config-json-nvme.json: fp16 dynamic loss scaling, WarmupLR, stage 3
with GPU hints, tensorboard, flops_profiler, activation_checkpointing) with only the NVMe path made
this test's and the parameters in host memory. Checked first: with only the optimizer's
nvme_path changed, offload_param stays on nvme in another directory (here one that does not
exist), which zinf accepts with an INFO line (it reads the parameter shards from the optimizer's
swap store and writes nothing there) for a model built inside zinf.torch.init, and refuses for a
model built outside it (nothing to partition), naming the fix. Then, parameters in host memory:
the optimizer opens with one INFO line naming the ignored keys and no warning, and trains with
opt.backward at the config's first loss scale, 2^16."""

import json
import os
import sys
import tempfile

import common
import zinf.errors
import zinf.torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "config", "deepspeed_configs", "config-json-nvme.json")


def stderr_of(fn):
    """fn()'s result and what this process wrote to fd 2 meanwhile (the engine's log lines)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            result = fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        return result, out.read().decode(errors="replace")


def main():
    work = sys.argv[1]
    with open(CONFIG) as f:
        cfg = json.load(f)
    swap = os.path.join(work, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = swap
    model = common.make_model()

    # offload_param.nvme_path other than the optimizer's: not used, said in an INFO line, and
    # nothing is made there. A model built outside init has nothing to partition: refused.
    param_path = cfg["zero_optimization"]["offload_param"]["nvme_path"]
    common.check(not os.path.exists(param_path), f"{param_path} exists on this machine")
    try:
        zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
        common.check(False, "offload_param nvme without a partitioned parameter was accepted")
    except zinf.errors.InvalidArgumentError as e:
        common.check("no parameter is partitioned" in str(e), f"unexpected message: {e}")
    # This test's model is small: every parameter is below the config's persistence threshold.
    small = json.loads(json.dumps(cfg))
    small["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with zinf.torch.init(small):
        partitioned = common.make_model()
    opt, log = stderr_of(lambda: zinf.torch.ZeroOptimizer(partitioned.named_parameters(),
                                                           config=small, progress=False))
    if opt.rank == 0:
        common.check(f'offload_param.nvme_path "{param_path}" not used' in log,
                     f"no INFO line on the unused offload_param.nvme_path:\n{log}")
    common.check(opt.num_partitioned_params > 0, "nothing partitioned")
    opt.close()
    common.check(not os.path.exists(param_path), f"{param_path} was created")

    cfg["zero_optimization"]["offload_param"]["device"] = "cpu"
    opt, log = stderr_of(lambda: zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg,
                                                           progress=False))
    rank, world = opt.rank, opt.world_size
    if rank == 0:
        lines = [l for l in log.splitlines() if "ignored, no effect in zinf: " in l]
        common.check(len(lines) == 1, f"{len(lines)} ignored-keys lines:\n{log}")
        for key in ("tensorboard", "flops_profiler", "activation_checkpointing",
                    "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                    "fp16.auto_cast"):
            common.check(key in lines[0], f"{key} not in: {lines[0]}")
        # The implemented keys are read, not named; of offload_param only pin_memory (no effect).
        named = lines[0].split("ignored, no effect in zinf: ", 1)[1].split(" (docs/")[0].split(", ")
        common.check("zero_optimization.offload_param.pin_memory" in named,
                     f"offload_param.pin_memory not in: {lines[0]}")
        for key in named:
            common.check(not key.startswith("zero_optimization.offload_param")
                         or key == "zero_optimization.offload_param.pin_memory",
                         f"{key} (implemented) in: {lines[0]}")
        common.check("zero_optimization.stage3_prefetch_bucket_size" not in named,
                     f"stage3_prefetch_bucket_size (implemented) in: {lines[0]}")
    warned = [l for l in log.splitlines()
              if ("[warn]" in l or "[error]" in l) and "unknown ZINF_" not in l]
    common.check(not warned, f"warnings: {warned}")
    settings = json.loads(opt._engine.effective_config)
    common.check(settings["fp16"]["enabled"] is True, "fp16 not enabled")
    common.check(opt.loss_scale == 65536.0, f"first loss scale {opt.loss_scale}, want 2^16")

    first = None
    for step in range(1, 6):
        x, y = common.batch(step)
        loss = common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world))
        opt.backward(loss)
        info = opt.step(loss=loss)
        first = info.loss if first is None else first
        common.check(not info.skipped and info.loss_scale == 65536.0,
                     f"step {step}: skipped {info.skipped}, scale {info.loss_scale}")
        common.check(abs(info.grad_norm) < 1e3, f"grad_norm {info.grad_norm}: not unscaled")
    opt.close()
    zinf.log(f"deepspeed_config: the reference config trained 5 steps on {world} rank(s): OK")


if __name__ == "__main__":
    main()
