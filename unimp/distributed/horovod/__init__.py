"""unimp with Horovod, one module per framework as Horovod has them (``horovod.torch``,
``horovod.tensorflow``):

- :mod:`unimp.distributed.horovod.torch`: unimp's torch ``GradScaler`` reduced over the ranks,
  Horovod's AMP pattern (``amp_step``) and the float16 compression that divides by
  scale x world size in float32 first;
- :mod:`unimp.distributed.horovod.tensorflow`: unimp's Keras ``LossScaleOptimizer`` reduced over
  the ranks, ``DistributedGradientTape`` and ``DistributedOptimizer``, with the same
  compression.

Each needs Horovod built for its framework: ``scripts/build_horovod.sh`` (Horovod 0.28.1, its
last release, patched to build against current torch and TensorFlow; Gloo, no MPI). Importing
this package imports neither framework nor Horovod.
"""
