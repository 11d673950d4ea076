"""Qwen4Exp (transformers' ``Qwen4ExpForCausalLM`` / the text model of
``Qwen4ExpForConditionalGeneration``): Gated DeltaNet linear attention and gated full
attention with the QSA indexer, sparse MoE with a shared expert, hyper-connection
streams, and PLE (hashed n-gram embeddings) on some linear-attention layers."""
