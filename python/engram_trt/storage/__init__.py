"""Writing files without losing a user's data (``atomic``): temporaries beside their
target, swapped in whole, locks, cleanup of what dead processes left. Every command that
writes (build, demo checkpoint, import, caches) goes through it."""
