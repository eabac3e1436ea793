"""torch.optim.Adam on NUMEL fp32 elements, timed: the torch side of bench/run.py adam-vs-torch.

    /usr/bin/python3 bench/harness/workers/adam_torch.py NUMEL THREADS STEPS

One untimed step (it allocates exp_avg and exp_avg_sq), then STEPS timed ones; prints one JSON
object with the best and the mean seconds per step.
"""
import json
import sys
import time


def main(numel, threads, steps):
    import torch  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, dtype=torch.float32))
    param.grad = torch.randn(numel, dtype=torch.float32) * 1e-3
    opt = torch.optim.Adam([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(json.dumps({"bench": "torch_adam", "torch_version": torch.__version__, "numel": numel,
                      "threads": threads, "steps": steps,
                      "foreach": opt.defaults.get("foreach"), "seconds": best,
                      "seconds_mean": sum(times) / len(times), "elements_per_s": numel / best,
                      "gb_per_s": numel * 28 / best / 1e9}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or not all(a.isdigit() and 0 < int(a) < 1 << 31 for a in sys.argv[1:]):
        sys.exit("usage: adam_torch.py NUMEL THREADS STEPS (run by bench/run.py adam-vs-torch)")
    main(*(int(a) for a in sys.argv[1:]))
