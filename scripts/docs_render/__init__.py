"""The machinery of scripts/docs.py, a module a job: `core` (result files, marker blocks, PNGs, the check),
`numbers` (no number outside markers), `common` (the registry's types and the helpers every page shares),
`registry` (every figure by NAME), `verdict_check` (recorded verdicts re-derived) and `pages/` (one module a
page: its figures' commands, collectors and views, most of them the command's own renderer).
docs/CONTRIBUTING.md says how to add a figure."""
