"""KVzap surrogate weights shipped with the package (`kvcompress.methods.kvzap.SHIPPED`), written by `kvcompress train-scorer`."""
