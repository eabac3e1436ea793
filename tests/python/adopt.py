"""zinf adopts MPI when mpi4py initialized it first, and leaves finalizing to mpi4py:
`mpirun -np N python3 adopt.py <swap dir>`. Prints "SKIP: ..." where mpi4py is missing."""

import sys

try:
    from mpi4py import MPI  # initializes MPI (MPI_THREAD_MULTIPLE by default)
except ImportError:
    print("SKIP: mpi4py is not installed (python3-mpi4py)", flush=True)
    sys.exit(0)

import common
import zinf
import zinf.torch


def main():
    facts = zinf.init()
    world = MPI.COMM_WORLD
    common.check(not facts["owns_mpi"], "zinf initialized MPI although mpi4py had")
    common.check((facts["rank"], facts["world_size"]) == (world.Get_rank(), world.Get_size()),
                 f"zinf's rank facts {facts} differ from mpi4py's")
    model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=common.config(sys.argv[1]),
                                   progress=False, create_nvme_paths=True)
    for step in range(1, 4):
        x, y = common.batch(step)
        common.loss_fn(model, common.shard(x, opt.rank, opt.world_size),
                       common.shard(y, opt.rank, opt.world_size)).backward()
        opt.step()
        opt.zero_grad()
    # The program's own MPI calls still work, before and after the optimizer closes.
    total = world.allreduce(opt.global_step, op=MPI.SUM)
    opt.close()
    common.check(total == 3 * world.Get_size(), f"allreduce gave {total}")
    world.Barrier()
    zinf.log(f"adopt: mpi4py's MPI on {world.Get_size()} rank(s), 3 steps")


if __name__ == "__main__":
    main()
