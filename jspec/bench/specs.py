"""`jspec bench`'s method specs and prompts: `name:key=value;key=value` entries of --methods, batch
sizes, Spec-Bench rows."""

from __future__ import annotations

import dataclasses
import json
import re

from jspec import methods, prompt_sets
from jspec.errors import JspecError

_NAME = re.compile(r"[A-Za-z][\w-]*(:|$)")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    label: str  # how results and tables name it: the spec as written (options normalised)
    name: str  # a jspec.methods name
    options: tuple = ()  # ((key, value), ...) for jspec.methods.build


def parse_methods(text: str) -> list[MethodSpec]:
    """`ar,early-exit:exit_layer=20;max_draft=6,...` -> specs, with plain `ar` first."""
    pieces: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if pieces and part and not _NAME.match(part):  # `skip_layers=4,6,8`: the list goes on
            pieces[-1] += "," + part
        else:
            pieces.append(part)
    specs = [_parse_method(p) for p in pieces]
    labels = [s.label for s in specs]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise JspecError(f"--methods names {dup!r} twice")
    ar = [s for s in specs if s.label == "ar"] or [MethodSpec("ar", "ar")]
    return ar + [s for s in specs if s.label != "ar"]


def _parse_method(piece: str) -> MethodSpec:
    name, colon, rest = piece.partition(":")
    name = name.strip()
    if not name:
        raise JspecError("--methods has an empty entry; write e.g. ar,ngram,early-exit:exit_layer=20")
    if name not in methods.METHODS:
        raise JspecError(f"unknown method {name!r} in --methods; choose among {', '.join(methods.METHODS)}")
    options, parts = [], [p.strip() for p in rest.split(";") if p.strip()]
    if colon and not parts:
        raise JspecError(f"method {name!r} has ':' but no options; write {name}:key=value;key=value")
    for part in parts:
        key, eq, value = (s.strip() for s in part.partition("="))
        key = key.replace("-", "_")
        if not eq or not value:
            raise JspecError(f"bad option {part!r} for method {name}: write key=value")
        if name not in methods.TAKES.get(key, ()):
            takes = [k for k, takers in methods.TAKES.items() if name in takers]
            raise JspecError(f"method {name} takes no option {key!r}; " +
                             (f"its options are {', '.join(takes)}" if takes else "it takes none"))
        if key in dict(options):
            raise JspecError(f"method {name} sets {key} twice in --methods")
        options.append((key, value))
    label = name + (":" + ";".join(f"{k}={v}" for k, v in options) if options else "")
    try:
        return MethodSpec(label, name, tuple((k, _value(k, v)) for k, v in options))
    except JspecError as e:  # the message names the option as a flag: say which entry set it
        raise JspecError(f"--methods {label}: {e}") from None


def _value(key: str, text: str):
    """The option's value as methods.build takes it: refused here, in one line, when its type or
    range is wrong."""
    option = methods.OPTIONS[key]
    values = [_scalar(v.strip()) for v in text.split(",")]
    value = tuple(values) if option.type == "layers" or len(values) > 1 else values[0]
    if option.type in ("str", "model") and value is not None:  # a name or a path (a draft model loads later)
        return text
    option.validate(value)
    return value


def _scalar(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_batch_sizes(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        given = [int(x) for x in text.split(",")]
    except ValueError:
        given = []
    sizes = sorted(set(given))
    if not sizes or sizes[0] < 1 or len(sizes) < len(given):
        raise JspecError(f"bad --batch-sizes {text!r}: write distinct positive integers like 1,8")
    return sizes


# -- prompts ---------------------------------------------------------------------------------------

def read_bench_prompts(path, limit: int | None = None) -> list[dict]:
    """Spec-Bench rows (`question_id`, `category`, `turns`: the first turn is the prompt) or jspec
    prompt rows (`id`, `prompt` or `messages`, optional `category`, default "all"), from a path (.gz
    too) or a shipped set's file (`prompt_sets.resolve`); `limit` keeps the first `limit` of each
    category, in file order."""
    from jspec.jsonl import read_prompts

    rows = []
    for lineno, line in enumerate(prompt_sets.read_text(path).split("\n"), 1):  # not splitlines: U+2028
        if line.strip():
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise JspecError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
    if rows and all(isinstance(o, dict) and "turns" in o for _, o in rows):
        prompts = []
        for i, (lineno, o) in enumerate(rows):
            turns = o["turns"]
            if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip()):
                raise JspecError(f"{path} line {lineno}: \"turns\" must be a list of strings, the first non-empty")
            prompts.append({"id": o.get("question_id", o.get("id", i)), "prompt": turns[0]})
    else:
        prompts = read_prompts(path)  # validates the jspec format (and the ids)
    for p, (_, o) in zip(prompts, rows):
        p["category"] = str(o.get("category") or "all") if isinstance(o, dict) else "all"
    ids = [p["id"] for p in prompts]
    if len(set(map(json.dumps, ids))) < len(ids):
        raise JspecError(f"{path} has duplicate question ids")
    if limit is not None:
        kept, seen = [], {}
        for p in prompts:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            if seen[p["category"]] <= limit:
                kept.append(p)
        prompts = kept
    return prompts
