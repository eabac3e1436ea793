"""The lists the engine owns and Python derives, checked against each other.

The error codes (core/status.h kErrorCodes) are zinf.errors' classes, one each.

One step record: the engine's StepInfo fields (engine/step_info.h) are zinf.torch.StepInfo's
attributes, the metrics file's keys (plus world_size) and the rows of docs/library.md's table,
in the same order; each metrics line holds the values the step returned; checkpoint_due follows
zinf.checkpoint.every and total_steps.

  mpirun -np N python3 records.py <work dir> <docs/library.md>
"""

import json
import os
import re
import sys

import common
import zinf
import zinf.errors
import zinf.torch
from zinf import _zinf

STEPS = 5
EVERY = 2


def doc_table_fields(path):
    """The field names of the table under "### What `Step` does", in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("### What `Step` does"):]
    section = section[:section.index("\n### ", 1)]
    fields = []
    for line in section.splitlines():
        m = re.match(r"^\| ((?:`[a-z_]+`(?:, )?)+) \|", line)
        if m:
            fields += re.findall(r"`([a-z_]+)`", m.group(1))
    return fields


def check_error_codes():
    codes = list(_zinf.ERROR_CODES)
    classes = {code: zinf.errors.class_for_code(code) for code in codes}
    generic = [code for code, cls in classes.items() if cls is zinf.errors.ZinfError]
    common.check(not generic, f"zinf.errors has no class for the engine's codes {generic}")
    common.check(sorted(zinf.errors._BY_CODE) == sorted(codes),
                 f"zinf.errors knows {sorted(zinf.errors._BY_CODE)}, the engine {sorted(codes)}")
    for code, cls in classes.items():
        common.check(cls.__name__ == code + "Error", f"{code}'s class is {cls.__name__}")


def main(work, library_md):
    facts = zinf.init()
    check_error_codes()
    fields = list(_zinf.STEP_INFO_FIELDS)
    common.check(fields == list(zinf.torch.StepInfo.__slots__),
                 f"zinf.torch.StepInfo's attributes {zinf.torch.StepInfo.__slots__} are not "
                 f"the engine's {fields}")
    documented = doc_table_fields(library_md)
    common.check(documented == fields,
                 f"{library_md}'s StepInfo table lists {documented}, the engine has {fields}")
    doc = zinf.torch.StepInfo.__doc__
    missing = [f for f in fields if f not in doc]
    common.check(not missing, f"zinf.torch.StepInfo's docstring lacks {missing}")

    world, rank = facts["world_size"], facts["rank"]
    cfg = common.config(os.path.join(work, "swap"), world=world)
    cfg["zinf"] = {"checkpoint": {"dir": os.path.join(work, "ckpt"), "every": EVERY}}
    metrics = os.path.join(work, "metrics.jsonl")
    model = common.make_model()
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config=cfg, metrics_path=metrics,
                                   total_steps=STEPS, create_nvme_paths=True)
    infos = []
    for step in range(1, STEPS + 1):
        x, y = common.batch(step)
        common.loss_fn(model, common.shard(x, rank, world), common.shard(y, rank, world)).backward()
        info = opt.step(loss=1.0 + step)
        opt.zero_grad()
        infos.append(info)
        want_due = step % EVERY == 0 or step == STEPS
        common.check(info.checkpoint_due == want_due,
                     f"step {step}: checkpoint_due {info.checkpoint_due}, expected {want_due}")
        if info.checkpoint_due:
            opt.save_checkpoint()
    opt.close()
    if rank == 0:
        with open(metrics, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        common.check(len(lines) == STEPS, f"{len(lines)} metrics lines, expected {STEPS}")
        for info, line in zip(infos, lines):
            common.check(sorted(line) == sorted(fields + ["world_size"]),
                         f"metrics keys {list(line)} are not the StepInfo fields + world_size")
            common.check(line["plan_bytes"] > 0, f"plan_bytes {line['plan_bytes']}")
            common.check(line["world_size"] == world, f"world_size {line['world_size']}")
            for key in fields:
                got, want = line[key], getattr(info, key)
                common.check(got == want, f"step {info.step}: metrics {key} = {got!r}, StepInfo "
                                          f"{want!r}")
        saved = sorted(os.listdir(os.path.join(work, "ckpt")))
        common.check({"step-2.h5", "step-4.h5", "step-5.h5"} <= set(saved),
                     f"checkpoints {saved}: expected step-2, 4 and 5")
    zinf.log(f"records: {len(_zinf.ERROR_CODES)} error codes and {len(fields)} StepInfo fields "
             f"agree (engine, zinf.errors, zinf.torch, metrics, docs)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
