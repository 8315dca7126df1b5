"""Comparing the metric rows of two runs that must compute the same mathematics."""

import numpy as np


def assert_metrics_close(expected: list[dict], actual: list[dict], *, rtol: float,
                         atol: float) -> None:
  """Every float metric of each row equal within (rtol, atol).

  Clip fractions count tokens past a threshold, so a rounding-level difference can move one
  token across it: they may differ by 0.02 (about 2 tokens of ~100 per minibatch).
  """
  assert len(expected) == len(actual)
  for a, b in zip(expected, actual):
    assert a.keys() == b.keys()
    for key in a:
      if isinstance(a[key], float):
        tol = 0.02 if key.endswith("clip_frac") else atol
        np.testing.assert_allclose(b[key], a[key], rtol=rtol, atol=tol, err_msg=key)
