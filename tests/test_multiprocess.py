"""Multi-process engines on the CPU (issue 17): the README's data-parallel examples, unchanged, in
two processes on localhost, agree with the same example in one process on every step's loss,
scale and skip.

* JAX: two processes, ``jax.distributed.initialize`` through the example's
  ``JAX_COORDINATOR_ADDRESS`` / ``NUM_PROCESSES`` / ``PROCESS_ID`` (CPU collectives: Gloo),
  2 CPU devices each: one mesh over 4 devices, as the one-process run's 4 devices.
* TensorFlow: ``tf.distribute.MultiWorkerMirroredStrategy`` with two workers (``TF_CONFIG``),
  one CPU each: 2 replicas, as the one-process run's MirroredStrategy over 2 logical CPUs.
  The TensorFlow example skips its step 1 (a float16 overflow at scale 32768) in both.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from conftest import require_backend

ROOT = pathlib.Path(__file__).parents[1]
TIMEOUT_S = 240
STEP = re.compile(r"^step \d+: loss \S+ scale \S+ applied \S+ on \d+ (devices|replicas)$")

pytestmark = pytest.mark.slow  # two framework processes per case: ~30-60 s on 2 cores


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3", **extra}
    for key in ("XLA_FLAGS", "TF_CONFIG", "JAX_COORDINATOR_ADDRESS"):
        if key not in extra:
            env.pop(key, None)
    return env


def _steps(out: str) -> list[str]:
    return [line for line in out.splitlines() if STEP.match(line)]


def _run_all(script: str, envs: list[dict[str, str]]) -> list[str]:
    """Starts one process per env, waits for all (killing all at the timeout), and returns each
    one's stdout; a failure names the process and shows the tail of its output."""
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / script)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    outs = []
    try:
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"process {i} of {script} did not finish in {TIMEOUT_S} s")
            if p.returncode != 0:
                pytest.fail(f"process {i} of {script} exited {p.returncode}:\n{out[-3000:]}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _jax_runs():
    port = _free_ports(1)[0]
    multi = [
        _env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", NUM_PROCESSES="2", PROCESS_ID=str(i))
        for i in range(2)
    ]
    single = [_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")]
    script = "examples/distributed/jax_shard_map.py"
    return _run_all(script, multi), _run_all(script, single)[0]


def _tf_runs():
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    multi = [
        _env(KERAS_BACKEND="tensorflow", TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}}))
        for i in range(2)
    ]
    script = "examples/distributed/tf_mirrored.py"
    return _run_all(script, multi), _run_all(script, [_env(KERAS_BACKEND="tensorflow")])[0]


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_two_processes_agree_with_one_on_every_step(backend):
    require_backend(backend)
    multi, single = _jax_runs() if backend == "jax" else _tf_runs()
    expected = _steps(single)
    assert len(expected) == 3, single[-2000:]
    for i, out in enumerate(multi):
        assert _steps(out) == expected, f"process {i}:\n{out[-2000:]}"
    if backend == "jax":
        assert all(line.endswith("on 4 devices") for line in expected)
        assert all("compilations 1" in out for out in multi)
    else:
        # the example's step 1 overflows float16 at scale 32768: skipped on both workers, and
        # the scale halves, as in one process
        assert [("applied False" in line) for line in expected] == [False, True, False]
        assert expected[2].split()[5] == "16384"
