"""The registered methods the shared tests (properties, conformance, precision, saved caches, stream memory) run on
small tensors and tiny random models: every method but KVzap, which scores a model's hidden states with weights
trained for one model (the shipped scorer fits the default model only). tests/test_kvzap.py runs KVzap in every mode on
a tiny model, with a scorer `kvcompress train-scorer` fits to it."""

import kvcompress as kvc

TRAINED_FOR_ONE_MODEL = ("kvzap",)
SHARED = [name for name in kvc.methods() if name not in TRAINED_FOR_ONE_MODEL]
