"""The machinery of scripts/docs.py, a module a job: `core` (result files, marker blocks, PNGs, the check),
`numbers` (no number outside markers), `common` (the registry's types and the helpers every page shares),
`registry` (every figure by NAME) and `pages/` (one module a page: its figures' commands, collectors and
views). docs/CONTRIBUTING.md says how to add a figure."""
