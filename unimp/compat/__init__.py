"""Porting shims for scripts written against older mixed-precision APIs (Apex amp, tf.keras 2)."""
