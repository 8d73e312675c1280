"""The compressed model on disk and in memory: stored tensors and runtime modules (`stored`), the
artifact folder (`artifact`), its dense export (`export`), loading either kind (`loading`), and the
remote code copied into every artifact (`hf/modeling_ftc.py`, torch and transformers only)."""
