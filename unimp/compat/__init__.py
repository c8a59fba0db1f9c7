"""Porting shims: scripts written against Apex amp (`unimp.compat.apex`), jmp (`unimp.compat.jmp`),
flax's DynamicScale (`unimp.compat.flax`) and TensorFlow 2.1-2.3's experimental mixed-precision
API (`unimp.compat.tf_experimental`) run by changing one import."""
