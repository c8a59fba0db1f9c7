"""Framework backends. Never import these directly at package import time: use
:func:`unimp.get_backend` (or ``unimp.mixed_precision``), which imports them on first use."""
