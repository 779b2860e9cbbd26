"""A rank's side of checkpoints: saving and loading engine state, the layout-free state, ZeRO
state views. The format, the reader and the trust checks are dsforge/ckpt's. May import
runtime/assemble and runtime/guard."""
