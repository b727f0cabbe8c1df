"""TVM's generic dlight rules, run after ours, made to pass a kernel on when they fail on it.

A dlight rule that claims a kernel and then cannot schedule it raises, and the raise ends the
whole build. Ours log the failure and leave the kernel to the next rule (the last rule,
dlight's Fallback on GPUs, or the unscheduled loop nest on CPUs, is always correct); this module
gives dlight's rules the same behaviour. Seen: with transformers 5.17 the rotary embedding's
outer product is a batched matmul whose reduction has extent 1 ((b, 32, 1) x (b, 1, 1)); dlight's
GEMV (CPU and GPU) claims it, then asserts that the kernel has a reduction loop.
"""
from __future__ import annotations

import logging

from tvm.s_tir.dlight.base import ScheduleRule

LOG = logging.getLogger("tvm_llm.schedules")

# what a failed schedule raises: TVM's errors are RuntimeError / ValueError / TypeError, dlight's
# analyses assert
SCHEDULE_ERRORS = (RuntimeError, AssertionError, ValueError, TypeError)


def left_to_next_rule(name: str, func, err: Exception, level: int = logging.WARNING) -> None:
    """Log that rule `name` failed on `func` (the kernel goes to the next rule); None."""
    LOG.log(level, "%s left %s to the next rule: %s", name,
            func.attrs.get("global_symbol", "a kernel") if func.attrs else "a kernel",
            (str(err).strip().splitlines() or [type(err).__name__])[-1][:200])
    return None


class PassingOnFailure(ScheduleRule):
    """`rule` (a dlight ScheduleRule) with a failure on a kernel it claimed logged at debug
    level (the next rule schedules the kernel correctly: nothing for a user to act on) and the
    kernel left to the next rule."""

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def is_target_available(self, target) -> bool:
        return self.rule.is_target_available(target)

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except SCHEDULE_ERRORS as err:
            return left_to_next_rule(type(self.rule).__name__, func, err, logging.DEBUG)
