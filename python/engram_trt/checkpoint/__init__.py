"""Checkpoints: lazy safetensors reading and deterministic writing (:mod:`.checkpoint`),
validation against the config and layout, and the built-in demo checkpoint (:mod:`.demo`)."""
