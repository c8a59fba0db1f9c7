"""``unimp doctor``: what went wrong in a run, read from its step logs. Framework-free.

:func:`diagnose` reads :class:`~unimp.steplog.StepLog` s (any backend) and finds episodes, each
a :class:`Finding` with a stable class id, its evidence steps, the layer where the log names
one, a summary in plain words and ranked :class:`Fix` es. With several logs of the same run
(one per framework) it diagnoses each, then says where they agree and where they differ.

A step is *bad data* when its batch held NaN or inf (``batch_finite`` false; such steps count
for ``nonfinite_input`` only), a *forward overflow* when its loss is not finite, and a
*gradient overflow* when its loss is finite and its gradients are not. The first layer that
went non-finite is the record's ``nonfinite``, else the first activation (forward order) or
gradient (backward order) with a non-finite count in its ``stats``. The classes, in the order
findings are ranked (root causes first; problems before normal events; a recurring layer
ranks after a rise of the learning rate, whose symptom it then probably is):

``nonfinite_input`` (error)
    batches holding NaN or inf. Fix: check the data at those steps.
``recurring_layer`` (error)
    one layer is the first to go non-finite in at least :data:`RECURRING_MIN` problem steps
    (forward overflows, the overflows of bursts, collapses and spikes) and in at least half of
    those where the log names one. Fix: keep that layer in float32.
``lr_change_before_overflow`` (warning)
    the learning rate rose :data:`LR_JUMP` times or more from one step to the next, at most
    :data:`LR_WINDOW` steps before (or at) the start of a forward overflow, a burst, a
    collapse or a spike. Fix: lower the learning rate or warm it up.
``forward_overflow`` (error from :data:`BURST_MIN` steps, else warning)
    non-finite losses: loss scaling cannot fix them (the scale is left alone). Fixes: keep the
    layer in float32, bfloat16.
``scale_collapse`` (error once it overflows at its floor, else warning)
    the scale fell :data:`COLLAPSE_BITS` powers of two (1024x) below its level after the
    start (after the calibration), or overflowed at its floor (``min_scale``; 2**-126 for
    ``None``). It starts at the first overflow of the run of overflows (at most
    :data:`CLUSTER_GAP` applied steps apart) that brought it there, or, when that run holds
    less than half of the overflows since the scale last grew (a slow slide), at the first of
    those; it ends where that run ends. Fixes: bfloat16, a gentler backoff (hysteresis),
    ``max_consecutive_skips`` when it sat at the floor for 10 steps or more.
``overflow_burst`` (warning)
    :data:`BURST_MIN` or more gradient overflows in a row outside a collapse. Such a run from
    step 0 is the initial scale calibrating: info, fix a lower ``init_scale``.
``scale_at_cap`` (info; warning with evidence)
    the scale sat at ``max_scale`` for ``growth_interval`` steps or more (a growth was
    blocked); a warning, fix raise ``max_scale``, when the statistics show more than
    :data:`FLUSH_WARN` of a gradient flushing to zero in float16 there.
``params_non_finite`` (error)
    the half-precision parameters held inf / NaN after a step (the record's
    ``params_finite``; :attr:`unimp.StepResult.params_finite`), typically an applied step
    with finite gradients whose update went non-finite in the parameters' dtype. Names the
    dtype; fixes: float32 master weights (a mixed recipe), an epsilon the dtype holds.
``half_overflow_recorded`` (warning)
    in a run that does not compute in float16 (``unimp audit``'s float32 steps), the
    statistics record elements that would overflow float16: per layer, how many and on how
    many steps, with the fixes for a float16 run.
``isolated_overflow``
    the other gradient overflows. After a growth of the scale since the previous overflow,
    or in the first :data:`CALIBRATION_STEPS` steps of a run from step 0, they are the dynamic
    scale probing upward: info, normal, no fix (``details["spike"]`` false). Without one they
    are spikes: warning, with the first non-finite layer named (``details["spike"]`` true).
``run_ended_early`` (warning)
    the end line says the run stopped on an exception (its type) or was interrupted
    (``KeyboardInterrupt``, ``SIGTERM``), after its last step.
``nothing_wrong`` (info)
    none of the above.

The loss-scale config (floor, cap, growth interval) is the log header's ``loss_scale``, else
its recipe's (:attr:`unimp.steplog.StepLog.recipe`, read as ``Recipe.from_dict`` or
``get_recipe`` would); without one (or for a static scale) the rules that need it are
skipped. The fixes follow that config and the recipe's compute dtype: a setting the run
already has is not suggested; the next step is, or nothing (:mod:`unimp.doctor.advice`).

Modules: ``findings`` (the thresholds and the report's classes), ``advice`` (the fixes that
depend on the config), ``rules`` (one log), ``compare`` (:func:`diagnose`, several logs),
``command`` (``unimp doctor``). This ``__init__`` only re-exports.

Example:
    >>> import io, os, tempfile
    >>> from unimp.steplog import StepLogWriter, read_steplog
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with StepLogWriter(path, backend="torch", framework_version="2.4") as w:
    ...     for i in range(5):
    ...         w.write({"step": i, "loss": 1.0, "scale": 1024.0, "applied": True,
    ...                  "loss_finite": True, "grads_finite": True, "grad_norm": None,
    ...                  "consecutive_skips": 0, "total_skips": 0})
    >>> [f.cls for f in diagnose([read_steplog(path)]).logs[0].findings]
    ['nothing_wrong']
"""

from unimp.doctor.command import doctor_command
from unimp.doctor.compare import diagnose
from unimp.doctor.findings import (
    BURST_MIN,
    CALIBRATION_STEPS,
    CLASSES,
    CLUSTER_GAP,
    COLLAPSE_BITS,
    DIAGNOSIS_FORMAT,
    FIXES,
    FLUSH_WARN,
    LR_JUMP,
    LR_WINDOW,
    RECURRING_MIN,
    Diagnosis,
    Finding,
    Fix,
    LogDiagnosis,
)

__all__ = [
    "BURST_MIN",
    "CALIBRATION_STEPS",
    "CLASSES",
    "CLUSTER_GAP",
    "COLLAPSE_BITS",
    "DIAGNOSIS_FORMAT",
    "FIXES",
    "FLUSH_WARN",
    "LR_JUMP",
    "LR_WINDOW",
    "RECURRING_MIN",
    "Diagnosis",
    "Finding",
    "Fix",
    "LogDiagnosis",
    "diagnose",
    "doctor_command",
]
