"""kangaroo: the first N layers and a trained adapter draft, stopping at a low-confidence token
(Kangaroo's double early exit); lossless."""

from jspec.methods.trained_head import method

METHOD = method("kangaroo", "the first N layers + a trained adapter; stops at low confidence", "confidence")
