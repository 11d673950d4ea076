"""The hot-row cache: an HBM cache of the Engram rows a step asks for most often
(``hotcache.HotRowCache``), its decisions (``policy.CachePolicy``) and their torch
reference (``reference``), which the CPU path runs and the GPU checks compare with."""
