"""A record: what jspec gives for one prompt (a dict, a line of a JSONL output), from its row of
a decoding program's outputs."""

from __future__ import annotations

from jspec.batching import Request
from jspec.errors import JspecError


def record(req: Request, i: int, out, stats: dict, seconds: float, drafter, tokenizer, policy: dict) -> dict:
    """The record of row i of a program's outputs (out [B, max_new], stats of [B, ...]) for `req`;
    `policy` is what it ran with (jspec.Model.policy: dtypes and matmul precision), which the
    record names, as does the error for a row whose first logits were not finite numbers."""
    if not stats["finite"][i]:
        raise JspecError(f"the model's first logits for prompt {req.id!r} are not finite numbers (NaN or "
                         f"infinity): its weights or its dtypes ({policy['dtype']} weights, "
                         f"{policy['activation_dtype']} activations) cannot run it")
    new = int(stats["new_tokens"][i])
    row = {k: v[i].tolist() for k, v in stats.items() if k not in ("top_ids", "top_logprobs", "finite")}
    ids = [int(t) for t in out[i, :new]]
    return {
        "id": req.id,
        "text": tokenizer.decode(ids) if tokenizer is not None else None,
        "token_ids": ids,
        "new_tokens": new,
        "prompt_tokens": len(req.token_ids),
        "seconds": round(seconds, 6),
        "tokens_per_second": round(new / seconds, 3) if seconds > 0 else None,
        "numerics": policy,
        "stats": {
            "rounds": row["rounds"],
            "batch_rounds": row["batch_rounds"],
            "drafted": row["drafted"],
            "accepted": row["accepted"],
            "mean_accepted_tokens": round(new / max(row["rounds"], 1), 4),
            "acceptance_rate": round(row["accepted"] / row["drafted"], 4) if row["drafted"] else None,
            **drafter.record_stats(row),
        },
        **{name: stats[name][i, :new] for name in ("top_ids", "top_logprobs") if name in stats},
    }
