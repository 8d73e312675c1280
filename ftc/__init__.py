"""FTC: post-training compression of LLM attention with shared Tucker factors.

Kept import-light on purpose: the job API imports `ftc.options` without pulling in torch.
"""

__version__ = "0.1.0"
