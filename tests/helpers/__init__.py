"""What the CPU tests share (tests/conftest.py keeps only pytest's hooks and fixtures), one
module per subject, imported as ``from helpers.<module> import name`` (tests/ is on the
path, as pytest puts it for conftest.py):

  files        the repository root, sha256 of a file or a tree, the golden vectors;
  checkpoints  the word tokenizer, tiny / small engram-llama checkpoints, transformers'
               greedy tokens and logits as references, FP8 folders as transformers writes them;
  cli          ``engram-trt run`` in-process: its JSON, its one-line refusal;
  plugins      the plugin harness, createPlugin, one-plugin ONNX graphs, plugin fields;
  serving      ``engram-trt serve`` behind a real tritonserver, its processes and segments.

The GPU tests' own helpers are tests/gpu/helpers.py (``gpu.helpers``).
"""
