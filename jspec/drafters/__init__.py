"""The drafters, one per file: jit code over the target's params and their own (dparams), with the
hooks of drafters.base.Drafter. A method (jspec.methods) builds one with its options."""
