"""StepInfo: what one ZeroOptimizer.step() did, its fields the engine's one list
(engine/step_info.h, _zinf.STEP_INFO_FIELDS)."""

from zinf import _zinf


class StepInfo:
    """What one step did; the figures are the same on every rank.

    step (1-based), lr, loss (mean over ranks; NaN when no loss was passed), grad_norm (before
    clipping; with fp16 of the unscaled gradient, Inf or NaN on a skipped step), clipped,
    loss_scale (the scale this step's gradient carried; 1 without fp16), next_loss_scale (the
    one for the next step: ZeroOptimizer.loss_scale), skipped (fp16: an Inf or NaN in the
    gradient on some rank skipped the step: no weight changed, no swap I/O, the schedule did not
    advance), skipped_steps (skipped steps so far, this one included), step_seconds and
    optimizer_seconds (slowest rank), swap_read_bytes and swap_write_bytes (all ranks, since the
    previous step), optimizer_swap_read_bytes and optimizer_swap_write_bytes (their part inside
    the optimizer step), read_bytes_per_element and write_bytes_per_element (the optimizer step's
    swap bytes per parameter element: about 12 with zinf.optimizer_state fp32, about 6 with q8),
    speculated (sub-groups stepped during the backward pass by the speculative step,
    zinf.speculative_step; all ranks) and of them speculation_committed, speculation_redone
    (stepped again: clipping applied, or the arguments changed) and speculation_discarded (an
    fp16 skip, a refused step), peak_rss_bytes (largest rank), plan_bytes and budget_bytes (the
    engine's host memory plan per rank and the budget it was held against, 0 when unknown),
    stop_requested (a stop signal arrived on some rank), stop_signal (this rank's, 0 if none)
    and checkpoint_due (zinf.checkpoint.dir is set and this step is a multiple of
    zinf.checkpoint.every, total_steps, or stop_requested: save now).
    """

    # The engine's one list of fields (engine/step_info.h), also the metrics file's keys.
    __slots__ = _zinf.STEP_INFO_FIELDS

    def __init__(self, fields):
        for key in self.__slots__:
            setattr(self, key, fields[key])

    def __repr__(self):
        return "StepInfo(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"
