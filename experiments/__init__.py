"""The experiment scripts, each run from the repository root as `python -m experiments.NAME`.

Owns nothing itself and imports nothing, so that `experiments.shapes` stays importable in
a virtual environment without this project's dependencies (the peer benchmark's). What
the scripts share lives in `results` (results pages), `common` (measuring helpers) and
`shapes` (model sizes, literals only).
"""
