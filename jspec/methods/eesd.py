"""eesd: the first N layers and a trained exit layer draft (EESD), the draft's length chosen by
Thompson sampling; verification reuses the shallow layers' work (lossless)."""

from jspec.methods.trained_head import method

METHOD = method("eesd", "the first N layers + a trained exit layer (Thompson-sampling controller)", "thompson")
