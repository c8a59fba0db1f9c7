"""A step log and `unimp doctor` in PyTorch: the run's records, then what went wrong.

`train_step(..., log=path)` writes one JSON Lines record per step (format `unimp.steplog/1`),
kept on the device and written every `log_every` steps and at `step.close()`. The batch of
step 5 holds a NaN; `unimp.doctor.diagnose` (what `unimp doctor run.jsonl` prints) names it.

    python examples/guides/steplog_torch.py [--log run.jsonl]
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before torch is imported
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", default=None, help="where to write the log (default: a temp dir)")
    ARGS = parser.parse_args()

import os  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

import unimp  # noqa: E402
from unimp.doctor import diagnose  # noqa: E402
from unimp.steplog import read_steplog  # noqa: E402


def main(log: str | None = None) -> dict:
    log = log or os.path.join(tempfile.mkdtemp(), "run.jsonl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mp = unimp.mixed_precision("mixed_float16", backend="torch", device="cpu")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = mp.train_step(model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                         log=log, log_every=4)
    for i in range(10):
        x = torch.randn(16, 8)
        if i == 5:
            x[0, 0] = float("nan")        # bad data at step 5
        step((x, torch.randint(0, 4, (16,))))
    step.close()                          # writes the last records and the end line

    run = read_steplog(log)
    skipped = [s["step"] for s in run.steps if not s["applied"]]
    print(f"{log}: {len(run.steps)} steps, skipped {skipped}")
    diagnosis = diagnose([run])
    print(diagnosis.render())
    return {"log": run, "diagnosis": diagnosis}


if __name__ == "__main__":
    main(ARGS.log)
