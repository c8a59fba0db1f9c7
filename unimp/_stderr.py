"""The command line's filter of the frameworks' native start-up logs on file descriptor 2
(TensorFlow, XLA, absl), which Python's warnings filters cannot reach."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["native_stderr_filtered"]


#: Lines the frameworks' native code logs to file descriptor 2 on start-up (TensorFlow, XLA and
#: absl: "oneDNN custom operations are on", "Could not find cuda drivers", cuDNN/cuBLAS factory
#: registration), some before absl's logging reads TF_CPP_MIN_LOG_LEVEL: the classic TF format
#: ``2026-01-01 12:00:00.123456: I tensorflow/...cc:113] ...``, absl's ``I0000 00:00:... file.cc:NN]``,
#: and absl's banner about logs written before ``absl::InitializeLog()``.
_NATIVE_LOG = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+\.(cc|h):\d+\]"
    r"|[IWEF]\d{4} \d\d:\d\d:[\d.]+\s+\d+ \S+\.(cc|h):\d+\]"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called)"
)


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Runs a command with the native (C/C++) writes to file descriptor 2 caught, and passes on
    every line that is not a framework's start-up log when it ends. Python's ``sys.stderr``
    keeps writing to the real stderr directly, so unimp's own messages and warnings are not
    delayed. The command line only: importing unimp as a library changes no descriptor."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):  # no usable descriptor 2 (an embedded interpreter): no filter
        yield
        return
    caught = tempfile.TemporaryFile()
    old_stderr = sys.stderr
    os.dup2(caught.fileno(), 2)
    sys.stderr = open(real, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)
        sys.stderr = old_stderr
        os.close(real)
        caught.seek(0)
        kept, in_record = [], False
        for line in caught.read().decode(errors="replace").splitlines(keepends=True):
            if _NATIVE_LOG.match(line):
                in_record = True  # a log record: dropped with its continuation lines
            elif not in_record or line.startswith(("Traceback", "Fatal Python error")):
                in_record = False
                kept.append(line)
        caught.close()
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
