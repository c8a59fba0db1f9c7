"""Shared test setup: which backends are under test.

``UNIMP_TEST_BACKENDS`` (comma-separated, default: every registered backend) lists the backends
this run must cover. A listed backend that cannot load FAILS the run; a backend not listed is
skipped with a reason that says so. Nothing is skipped silently.
"""

from __future__ import annotations

import os

import pytest

from unimp import registry


def backends_under_test() -> list[str]:
    raw = os.environ.get("UNIMP_TEST_BACKENDS", "").strip()
    if not raw:
        return registry.list_backends()
    names = [registry.backend_info(n).name for n in raw.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def require_backend(name: str):
    """Returns the backend module, skips (with a reason) when the backend is not under test,
    and fails when it is under test but cannot be loaded."""
    if name not in backends_under_test():
        pytest.skip(
            f"backend {name!r} not in UNIMP_TEST_BACKENDS={os.environ.get('UNIMP_TEST_BACKENDS')!r}",
            allow_module_level=True,
        )
    try:
        return registry.get_backend(name)
    except ImportError as e:  # listed but missing: that is a failure, never a skip
        pytest.fail(f"backend {name!r} is under test but cannot be loaded: {e}", pytrace=False)


BACKENDS = backends_under_test()


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The name of each backend under test, in the test id."""
    require_backend(request.param)
    return request.param


def edited_state_dict(config, **changes):
    """``unimp.state_dict(config)`` with keys replaced or (value ``KeyError``) deleted; a path
    like ``state__counter`` reaches into nested dicts. For corrupt-state_dict tests."""
    from unimp import state_dict

    d = state_dict(config)
    for path, value in changes.items():
        where = d
        *head, last = path.split("__")
        for h in head:
            where = where[h]
        if value is KeyError:
            del where[last]
        else:
            where[last] = value
    return d


def step_raw(**changes):
    """The raw device values of one :class:`unimp.StepResult` (NumPy scalars), with ``changes``."""
    import numpy as np

    raw = dict(
        loss=np.float32(0.5),
        scale=np.float32(1024),
        applied=np.bool_(True),
        loss_finite=np.bool_(True),
        grads_finite=np.bool_(True),
        grad_norm=None,
        consecutive_skips=np.int32(0),
        total_skips=np.int32(2),
    )
    raw.update(changes)
    return raw
