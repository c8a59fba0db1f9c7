"""``unimp doctor LOG... [--json]``: the command body (``unimp.cli`` parses the arguments)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from unimp.doctor.compare import diagnose
from unimp.steplog import StepLogWarning, read_steplog


def doctor_command(args: argparse.Namespace) -> int:
    """Reads every log in ``args.logs``, prints the diagnosis (text, or JSON with
    ``args.json``) and each reader warning on stderr as one line.

    Returns:
        0 once diagnosed, problems found or not.

    Raises:
        ValueError: a missing, empty, malformed or unknown-version log (``unimp.cli`` prints it
            as ``unimp doctor: error: ...`` and exits 2), before anything is printed.
    """
    logs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepLogWarning)  # printed below, one line each
        for path in args.logs:
            logs.append(read_steplog(path))
    for log in logs:
        for w in log.warnings:
            print(f"unimp doctor: warning: {w}", file=sys.stderr)
    diagnosis = diagnose(logs)
    print(json.dumps(diagnosis.to_dict(), indent=2) if args.json else diagnosis.render())
    return 0
