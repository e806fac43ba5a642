"""eagle: a trained head over the target's last state at the previous position drafts, running
none of the target's layers (EAGLE); lossless."""

from jspec.methods.trained_head import method

METHOD = method("eagle", "a trained head over the target's last state at the previous position: no target layer "
                "runs", "confidence")
