"""Compressing a model: the methods bound to their names (`methods`), the layer-by-layer pipeline
(`pipeline`), measured sensitivities and layer plans (`sensitivity`), and the one entry point from
options to artifact (`compress`)."""
