"""DeepSeek-V4 (transformers' ``DeepseekV4ForCausalLM``) and DeepSeek-V4.1 (the same
backbone with this project's Engram layers): CSA / HCA compressed attention, mHC
hyper-connections with Sinkhorn-Knopp, hash-routed and top-k MoE with a shared expert,
the hyper head."""
