"""zinf.torch: ZeroOptimizer, a torch.optim optimizer whose Adam state lives on NVMe.

    import torch, zinf.torch
    model = MyModel()                                   # the same initial weights on every rank
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config="ds.json")  # or a dict
    for batch in loader:                                # each rank its own shard of the data
        loss = model(batch).mean()
        opt.backward(loss)              # loss.backward() times opt.loss_scale (1 without fp16)
        info = opt.step(loss=loss)      # reduce-scatter, clip, lr, swapped Adam, all-gather
        opt.zero_grad()
        if info.step % 500 == 0:
            opt.save_checkpoint("ckpt", client_state={"epoch": epoch})
        if info.stop_requested:         # SIGUSR1/SIGTERM/Ctrl-C on some rank: save and stop
            opt.save_checkpoint("ckpt"); break

launched with ``mpirun -np N python3 train.py`` (or ``zinf-run -np N -- python3 train.py``).
At ZeRO stage 3 the model is built inside ``with zinf.torch.init(config): model = MyModel()``
(each rank keeps its shard of every parameter; the optimizer's hooks gather them around each
module's forward and backward) and read whole inside ``zinf.torch.gathered(params)``.
The config is a DeepSpeed JSON file or dict (docs/deepspeed-keys.md); the optimizer, gradient
clipping and batch sizes come from it. Param groups may give their own lr, betas, eps and
weight_decay, and param_groups is what each step uses: torch's lr schedulers drive it (or the
config's scheduler block does, not both). docs/python.md teaches the rest.

The package: zinf.torch.optimizer (ZeroOptimizer), zinf.torch.stage3 (init, gathered and the
hooks of partitioned parameters), zinf.torch.params (a parameter and its group as the optimizer
registers them), zinf.torch.step_info (StepInfo), zinf.torch.config (what zinf.torch reads of the
config itself) and zinf.torch.messages (log). The names below are the package's API.
"""

from .messages import log
from .optimizer import ZeroOptimizer
# _PartitionedLinear: tests/python/stage3.py checks its backward against F.linear's.
from .stage3 import (_PartitionedLinear, gathered, init, is_partitioned,  # noqa: F401
                     partitioned_shape, register_external_parameter)
from .step_info import StepInfo

__all__ = ["ZeroOptimizer", "StepInfo", "log", "init", "gathered", "is_partitioned",
           "partitioned_shape", "register_external_parameter"]
