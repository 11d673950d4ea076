"""The serving runtime: one packed step (:mod:`.step`) that every backend takes, the
table store and prefetcher that stage each step's Engram rows on a side CUDA stream,
the backends (``torch``: the reference model with the project's kernels; ``tensorrt``:
the engine), the engine folder reader and the scheduler that batches requests as they
arrive. ``engram_trt.llmapi.LLM`` is the user-facing API over it."""
