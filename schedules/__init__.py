"""The shared schedule language: IR, schedule families, lowering, validation, trace metrics."""
from ._face import lazy_face

# module -> the names this package exports from it, imported on first use (schedules._face)
__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "ir": ("ACT", "ALLREDUCE", "COMPUTE_KINDS", "COPY", "GRAD", "OPTIM", "RECV", "SEND", "B", "F", "Op", "Schedule",
           "ScheduleError", "W", "make_schedule", "message_key", "parse_op"),
    "lower": ("lower",),
    "registry": ("build", "families", "get", "names"),
    "trace": ("step_metrics", "to_chrome"),
    "validate": ("check_structure", "symbolic_run", "validate"),
})
