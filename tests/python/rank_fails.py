"""One rank of a zinf.torch job fails, the others must not wait for it: `mpirun -np N python3
rank_fails.py <case> <work dir>` (driven by rank_fails_test.sh, which bounds the job to 60 s,
checks the ERROR or exception each case must name, and then runs the case `clean` on the same
swap directory, which must find no live store and leave none).

Cases, all with rank 1 as the one that fails while the others go on to step():
  raise    rank 1 raises ZeroDivisionError between backward() and step()
  sigint   Ctrl-C reaches rank 1 alone (stop_signals=False: Python's KeyboardInterrupt)
  close    rank 1 calls opt.close() while the others call opt.step()
  gc       rank 1 drops its optimizer (del opt; gc.collect()) and goes on
  exit     rank 1 calls sys.exit(3) in the middle of the loop
  stall    rank 1 sleeps past zinf.collective_timeout_seconds (10 s) before its step
  clean    one step on every rank, then close: the swap directory must be empty after it
Each rank that catches a zinf error writes "rank R: raised <class>: <message>" to
<work dir>/rank<R>.txt before raising it again."""

import gc
import os
import signal
import sys
import time

import common
import zinf.torch


def main():
    case, work = sys.argv[1], sys.argv[2]
    swap = os.path.join(work, "swap")
    os.makedirs(swap, exist_ok=True)
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    # The stall case only: a short bound would fail the other runs on a loaded machine.
    cfg = common.config(swap, world=world,
                        zinf={"collective_timeout_seconds": 10 if case == "stall" else 600})
    model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False,
                                   stop_signals=case != "sigint")
    failing = rank == 1
    try:
        for step in range(1, 4):
            x, y = common.batch(step)
            common.loss_fn(model, common.shard(x, rank, world),
                           common.shard(y, rank, world)).backward()
            if step == 2 and failing:
                if case == "raise":
                    print(1 / 0)
                elif case == "sigint":
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(30)  # KeyboardInterrupt arrives here
                elif case == "close":
                    opt.close()
                elif case == "gc":
                    del opt
                    gc.collect()
                    time.sleep(30)  # going on with something else
                    return
                elif case == "exit":
                    sys.exit(3)
                elif case == "stall":
                    time.sleep(45)
            opt.step()
            opt.zero_grad()
        if case == "clean":
            opt.close()
            left = os.listdir(swap)
            if left:
                raise SystemExit(f"rank {rank}: the swap directory still holds {left}")
            print(f"rank {rank}: clean", flush=True)
    except zinf.ZinfError as e:
        common.report_raised(rank, work, e)
        raise


if __name__ == "__main__":
    main()
