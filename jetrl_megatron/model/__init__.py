"""The model description shared by every layer, with no Megatron-Core or vLLM code: shapes (presets, HF config.json)
and the parameter layout (HF <-> Megatron names, TP/PP splits)."""
