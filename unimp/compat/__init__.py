"""Porting shims: scripts written against Apex amp (`unimp.compat.apex`), jmp (`unimp.compat.jmp`)
and flax's DynamicScale (`unimp.compat.flax`) run by changing one import."""
