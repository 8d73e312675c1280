"""FTC: post-training compression of LLM attention with shared Tucker factors.

One subpackage per concern (docs/architecture.md): `numerics` (factorizations on tensors), `models`
(base models, hub ids, architecture families, checkpoints), `runtime` (stored tensors, artifacts,
export, loading, the remote code), `evaluation` (text data, perplexity, downstream tasks) and
`compression` (methods, the layer pipeline, sensitivities, `compress()`); option names in `options`.

Kept import-light on purpose: the job API imports `ftc.options` without pulling in torch.
"""

__version__ = "0.1.0"
