"""The Engram mechanism, as docs/engram-spec.md states it: tokenizer compression,
layout (primes, offsets, multipliers), the n-gram hash, FP8 rows and the gated fusion.
NumPy first (the reference), PyTorch where the model needs it; no I/O, no devices."""
