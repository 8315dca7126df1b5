"""The child process of `data/math_reward.py`: math-verify equivalence checks, one per line.

Run as a script (`python math_verify_worker.py`), never imported by the package: it needs
only the `math-verify` library, so it starts without jax. Protocol on stdin/stdout, one
JSON object per line in, one line out:

  {"gold": "\\frac{1}{2}", "pred": "0.5"}   ->   "1"   (equivalent)  or  "0"

Startup prints "ready" once the library is imported, or "error: <why>" and exits. The
parent bounds every check with a deadline and kills this process when one overruns
(sympy can run unboundedly long inside C code, e.g. on 9^{9^{9^9}}, where a Python
signal could not interrupt it), so the checks here run without math-verify's own
signal-based timeouts, which would also refuse to run outside a main thread.
"""

import json
import logging
import os
import sys


def _equivalent(parse, verify, gold: str, pred: str) -> bool:
  # Both sides as inline LaTeX: math-verify then reads plain numbers ("0.5", "1,000")
  # as well as expressions ("\frac{\sqrt 3}{2}").
  gold_parsed = parse(f"${gold}$", parsing_timeout=None)
  pred_parsed = parse(f"${pred}$", parsing_timeout=None)
  if not gold_parsed or not pred_parsed:
    return False
  return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def main() -> None:
  # Run by path: this file's directory (the package's data/) is first on sys.path, where
  # its module names could shadow installed ones; the worker imports nothing from it.
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
  out = sys.stdout.buffer
  try:
    from math_verify import parse, verify
  except ImportError as e:
    out.write(f"error: math-verify is not installed ({e}); pip install "
              "'math-verify>=0.9.0'\n".encode())
    out.flush()
    return
  # Its warnings that timeouts are off: they are, on purpose (the parent bounds them).
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  out.write(b"ready\n")
  out.flush()
  for line in sys.stdin.buffer:
    try:
      request = json.loads(line)
      ok = _equivalent(parse, verify, str(request["gold"]), str(request["pred"]))
    except Exception:  # noqa: BLE001  (a check that fails is a wrong answer, not a crash)
      ok = False
    out.write(b"1\n" if ok else b"0\n")
    out.flush()


if __name__ == "__main__":
  main()
