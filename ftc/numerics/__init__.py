"""The factorizations and their error metric, on plain tensors: whitening and the scaled SVD
(`metric`, `lowrank`), Tucker and CP factor groups (`tucker`, `cp`), and how a budget is spread over
layers (`allocation`). Nothing here knows about models, files or evaluation."""
