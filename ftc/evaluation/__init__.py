"""Text and task data and the scores measured on them: calibration and evaluation text with the
vendored WikiText-2 files (`data`, `data/`), perplexity (`evaluate`), downstream tasks through
lm-evaluation-harness (`downstream`, the `ftc` backend in `harness`, the task configs in `tasks/`).

Imports nothing: `ftc.evaluation.tasks` stays importable without torch."""
