"""``engram-trt build``'s defaults, importable without torch or onnx (the CLI's parser
shows them in ``--help`` before it knows which subcommand runs)."""

PLUGIN_MODES = ("embed", "reference")
BUILD_DTYPES = ("bf16", "fp16")
DEFAULT_MAX_BATCH = 4
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_NUM_TOKENS = 2048
