"""The zinf.torch session around the optimizer: `mpirun -np N python3 session.py <case> <work dir>`.

Cases:
  calls         rank 0 in zinf.torch.gathered(model, modify=True) before the optimizer exists,
                the others in ZeroOptimizer(...): every rank raises FailedPreconditionError
                naming each rank's call ("the ranks are in different calls (rank 0 in gathered(),
                rank 1 in ZeroOptimizer()) ...") within seconds, not after the 600 s wait of an
                untagged collective (the test's TIMEOUT is far below it).
  dropped       an optimizer dropped without close() (del opt; no gc.collect()) and a new one on
                the same nvme_path and job: the new one takes the dropped one's swap store over
                and trains; a new one while the old is still open (opt2 = ZeroOptimizer(...)
                with opt alive) raises AlreadyExistsError saying it is this process's own open
                optimizer and to close() it, and after close() the new one opens.
  client_state  save_checkpoint/load_checkpoint give client_state back exactly (None stays None,
                {} stays {}, 64-bit integers stay integers, floats, strings), and refuse on every
                rank, nothing saved, what JSON would change: an integer beyond 64 bits, a tuple,
                a key that is not a str.
Each rank prints "rank R: <case> OK" at the end."""

import os
import re
import sys

import torch

import common
import zinf.torch


def expect(what, cls, pattern, action):
    """`action` raises `cls` with a message matching `pattern` (on this rank)."""
    try:
        action()
    except cls as e:
        common.check(re.search(pattern, str(e)) is not None,
                     f"{what}: the message does not match {pattern!r}: {e}")
        return e
    except Exception as e:  # noqa: BLE001 - reported as the failure it is
        common.check(False, f"{what}: raised {type(e).__name__}: {e}, expected {cls.__name__}")
    common.check(False, f"{what}: nothing raised, expected {cls.__name__}")


def calls(work, rank, world):
    cfg = common.config(os.path.join(work, "swap"), world=world)
    cfg["zero_optimization"]["stage"] = 3
    torch.manual_seed(0)
    with zinf.torch.init(cfg):
        model = common.make_model()
    pattern = (r"the ranks are in different calls \(rank 0 in gathered\(\), rank 1 in "
               r"ZeroOptimizer\(\)")
    if rank == 0:
        def set_weights():
            with zinf.torch.gathered(model, modify=True):
                pass
        e = expect("gathered() against ZeroOptimizer()", zinf.errors.FailedPreconditionError,
                   pattern, set_weights)
    else:
        e = expect("ZeroOptimizer() against gathered()", zinf.errors.FailedPreconditionError,
                   pattern, lambda: zinf.torch.ZeroOptimizer(model.named_parameters(),
                                                             config=cfg, progress=False,
                                                             create_nvme_paths=True))
    common.check(e.agreed, "the error is not marked as raised on every rank")


def dropped(work, rank, world):
    cfg = common.config(os.path.join(work, "swap"), world=world)
    model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    common.train(model, opt, 1)
    del opt  # dropped without close(): kept open until exit, with its swap store
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    common.train(model, opt, 2)
    common.check(opt.global_step == 2, f"the new optimizer is at step {opt.global_step}")

    def second():
        zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    expect("a second optimizer beside an open one", zinf.errors.AlreadyExistsError,
           r"another ZeroOptimizer of this process, still open, holds this swap store: close\(\) "
           r"it before creating a new one", second)
    opt.close()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    common.train(model, opt, 1)
    opt.close()


def same(a, b):
    """Equal values of the same types, all the way down (dict key order aside)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return repr(a) == repr(b)  # -0.0 is not 0.0
    return a == b


def client_state(work, rank, world):
    cfg = common.config(os.path.join(work, "swap"), world=world)
    model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, progress=False)
    common.train(model, opt, 1)
    ckpt = os.path.join(work, "ckpt")
    exact = [None, {}, {"a": None, "b": [None, {}]}, {"n": 2**64 - 1, "m": -2**63, "k": 7},
             {"f": 0.1, "g": -0.0, "h": 1e308, "t": True, "s": "é\u0000\""}]
    for state in exact:
        path = opt.save_checkpoint(ckpt, client_state=state)
        back = opt.load_checkpoint(path)
        common.check(same(back, state) and same(opt.client_state, state),
                     f"client_state {state!r} came back as {back!r} ({opt.client_state!r})")
    saved = opt.global_step
    refused = [({"n": 2**64}, r"client_state\['n'\] is the int 18446744073709551616, beyond 64 "
                r"bits, which would come back as a float"),
               ({"deep": [{"n": -2**63 - 1}]}, r"client_state\['deep'\]\[0\]\['n'\] is the int"),
               ({"t": (1, 2)}, r"client_state\['t'\] is a tuple, which would come back as a list"),
               ({1: "a"}, r"client_state has the int key 1, which would come back as a str")]
    for state, pattern in refused:
        before = sorted(os.listdir(ckpt))
        expect(f"client_state {state!r}", zinf.errors.InvalidArgumentError,
               r"^InvalidArgument: rank 0: save_checkpoint: " + pattern,
               lambda: opt.save_checkpoint(ckpt, client_state=state))
        common.check(sorted(os.listdir(ckpt)) == before, f"{state!r}: something was saved")
    common.check(opt.global_step == saved, "the optimizer changed")
    opt.close()


def main():
    case, work = sys.argv[1], sys.argv[2]
    os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    facts = zinf.init()
    rank, world = facts["rank"], facts["world_size"]
    {"calls": calls, "dropped": dropped, "client_state": client_state}[case](work, rank, world)
    print(f"rank {rank}: {case} OK", flush=True)


if __name__ == "__main__":
    main()
