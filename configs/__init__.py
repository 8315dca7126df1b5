"""Experiment configs (ml_collections): `get_config(variant)` per module.

Importable from the repository root (`from configs import quickstart`), and loadable by
path on the command line (`--config=configs/quickstart.py:tiny`).
"""
