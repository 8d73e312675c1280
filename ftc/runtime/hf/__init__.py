"""The compressed model as transformers sees it (its modeling file is copied into every artifact)."""
