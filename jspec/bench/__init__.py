"""Measuring and judging: `jspec bench` (method specs, runs, the report, Hugging Face's peers),
`jspec compare` (where two outputs part), the quality of a lossy method's output (NLL under the
full model), and what a compiled program holds (hlo)."""
