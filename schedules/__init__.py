"""The shared schedule language: IR, schedule families, lowering, validation, trace metrics."""
from .ir import (ACT, ALLREDUCE, COMPUTE_KINDS, COPY, GRAD, OPTIM, RECV, SEND, B, F, Op, Schedule, ScheduleError, W,
                 make_schedule, message_key, parse_op)
from .lower import lower
from .registry import build, families, get, names
from .trace import step_metrics, to_chrome
from .validate import check_structure, symbolic_run, validate

__all__ = ["ACT", "ALLREDUCE", "B", "COMPUTE_KINDS", "COPY", "F", "GRAD", "OPTIM", "RECV", "SEND", "W",
           "Op", "Schedule", "ScheduleError", "make_schedule", "message_key", "parse_op", "lower", "build",
           "families", "get", "names", "check_structure", "symbolic_run", "validate", "step_metrics", "to_chrome"]
