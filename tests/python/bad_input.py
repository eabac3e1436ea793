"""A bad input must raise the same zinf exception on every rank, never hang or abort:
`mpirun -np N python3 bad_input.py <case> <work dir>` (driven by expect_error.sh), for the cases
shape (a parameter that changes shape), transposed (a square weight's .data replaced by its
transpose: the same memory and shape, other strides; changes.py has the other changes of a
parameter or gradient, grouped in one run), dtype (a float64 model), fp16_disabled (a float16 model
without the config's fp16.enabled), swap_dir (a missing nvme_path),
config_key (a misspelt key), io_fault (ZINF_FAULT_INJECT fails a write on one rank),
client_state (a client state that is not JSON) and client_state_deep (JSON nested deeper than a
checkpoint restore reads). Each rank writes "rank R: raised <class>: <msg>"
to <work dir>/rank<R>.txt and lets the exception end the program."""

import os
import sys

import torch

import common
import zinf.torch


def main():
    case, work = sys.argv[1], sys.argv[2]
    swap = os.path.join(work, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg = common.config(swap)
    model = common.make_model(hidden=256)  # ~80k parameters: several sub-groups to swap
    rank = zinf.init()["rank"]
    try:
        if case == "shape":
            opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
            common.train(model, opt, 2)
            model[2].weight.data = torch.zeros(128, 256)
            opt.step()
        elif case == "transposed":
            opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
            common.train(model, opt, 1)
            model[2].weight.data = model[2].weight.data.t()
            common.train(model, opt, 1)
        elif case == "dtype":
            zinf.torch.ZeroOptimizer(model.double().named_parameters(), config=cfg)
        elif case == "fp16_disabled":  # float16 parameters, the config without fp16.enabled
            zinf.torch.ZeroOptimizer(model.half().named_parameters(), config=cfg)
        elif case == "swap_dir":
            cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = os.path.join(work, "no")
            zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
        elif case == "config_key":
            cfg["zero_optimization"]["sub_group_sise"] = 1000
            zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
        elif case == "io_fault":
            opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
            common.train(model, opt, 3)
        elif case == "client_state":
            opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
            common.train(model, opt, 1)
            opt.save_checkpoint(os.path.join(work, "ckpt"), client_state={"t": torch.zeros(1)})
        elif case == "client_state_deep":  # JSON, but deeper than a restore reads back
            opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg)
            common.train(model, opt, 1)
            deep = {}
            for _ in range(100):
                deep = {"k": deep}
            opt.save_checkpoint(os.path.join(work, "ckpt"), client_state=deep)
        else:
            raise SystemExit(f"unknown case {case}")
    except zinf.ZinfError as e:
        common.report_raised(rank, work, e)
        raise
    print(f"rank {rank}: nothing raised", flush=True)


if __name__ == "__main__":
    main()
