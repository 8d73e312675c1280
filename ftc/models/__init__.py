"""Base models as the library reads them: hub ids (`hub`, torch-free: the API imports it), the
model names and where their files are (`registry`), architecture families and their projections
(`arch`), and checkpoints read tensor by tensor (`weights`).

Imports nothing: `ftc.models.hub` stays importable without torch."""
