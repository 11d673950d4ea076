"""Serving through Triton Inference Server: a model repository whose one model,
``engram_llm``, runs :class:`engram_trt.LLM` in Triton's Python backend.

Why a Python-backend model over ``LLM`` rather than a TensorRT-LLM-style C++ backend:
the scheduler that batches requests as they arrive, the table stores and the prefetcher
are all in the Python runtime; the model only hands Triton's requests to that one
scheduler and streams its deltas back. The model is *decoupled*: ``execute`` submits
each request and returns at once, and the responses are sent later, from a sender
thread, as the scheduler produces tokens. So requests from many clients share the
scheduler's steps instead of waiting for each other.

Modules:

- :mod:`.tensors`: the tensor names and types (those of the TensorRT-LLM backend) and the
  parsing of one request's inputs into a prompt and :class:`~engram_trt.SamplingParams`;
- :mod:`.repo`: writes the model repository (``config.pbtxt`` + ``1/model.py``), in a new
  folder renamed into place;
- :mod:`.model`: the model that runs inside Triton: requests in, responses out;
- :mod:`.metrics`: the Engram and scheduler counters as Triton custom metrics (Prometheus
  text on Triton's metrics port);
- :mod:`.server`: finds ``tritonserver`` (on PATH, or the one the ``nvidia-pytriton`` wheel
  ships), starts it, waits until the model is ready, stops it;
- :mod:`.client`: minimal standard-library clients of the HTTP ``generate`` /
  ``generate_stream`` endpoints.

Nothing here imports torch or Triton at import time: the CLI's ``--help`` stays instant
and the repository writer runs where neither is installed.
"""

from __future__ import annotations

MODEL_NAME = "engram_llm"
