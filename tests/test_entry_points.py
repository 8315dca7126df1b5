"""The commands a user types: a quiet start, `--help` that says what and how, and the
package installing the same commands."""

import ast
import configparser
import glob
import importlib.util
import os
import re
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What library start-up chatter looks like (none of it means anything for a run).
NOISE = ("Unable to initialize backend", "overriding jax.Array", "Downloading and preparing",
         "downloaded and prepared to", "Subsequent calls will reuse")


def child_env():
  # No device count: the entry point asks for its own 8 devices.
  return xla_env.child_env(PYTHONPATH=ROOT)


@pytest.mark.long
def test_the_main_job_starts_quietly_and_ends_with_its_summary(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "pipe_rlhf_jax.main", "--config=configs/quickstart.py:tiny",
       "--config.plan.mode=sequential", "--config.reward.fn=reverse_accuracy",
       "--config.ppo.critic_init=sft", "--config.ppo.steps=2",
       "--config.log.tensorboard=False", f"--workdir={tmp_path / 'run'}"],
      cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout + out.stderr
  noisy = [line for line in text.splitlines() if any(n in line for n in NOISE)]
  assert not noisy, noisy
  first = next(line for line in text.splitlines() if line.strip())
  assert first.startswith("[pipe_rlhf_jax] plan"), first  # the plan comes first
  assert "Run summary" in out.stdout and "wall time" in out.stdout


# (module, the kind of parser) of every entry point.
ENTRY_POINTS = [("pipe_rlhf_jax.main", "absl"), ("pipe_rlhf_jax.plan", "absl"),
                ("pipe_rlhf_jax.launch", "argparse"),
                ("pipe_rlhf_jax.planner.calibrate", "argparse"),
                ("pipe_rlhf_jax.models.random_checkpoint", "argparse")]


@pytest.mark.parametrize("module,kind", ENTRY_POINTS)
def test_help_says_what_it_does_with_an_example(module, kind):
  out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
  # absl ends --help with status 1 (it prints the usage as for a usage error).
  assert out.returncode == (1 if kind == "absl" else 0), out.stderr[-2000:]
  text = out.stdout + out.stderr
  assert f"python -m {module}" in text, text[:2000]  # an example command
  assert len(re.findall(r"[a-z]{3,}", text)) > 30  # and words about what it does


def test_the_package_installs_the_same_commands_with_one_version(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(tmp_path), ROOT], check=True, timeout=300,
                 capture_output=True)
  (wheel,) = glob.glob(str(tmp_path / "pipe_rlhf_jax-*.whl"))
  import pipe_rlhf_jax
  assert f"pipe_rlhf_jax-{pipe_rlhf_jax.__version__}-" in os.path.basename(wheel)
  with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("entry_points.txt"))
    points = configparser.ConfigParser()
    points.read_string(z.read(name).decode())
  scripts = dict(points["console_scripts"])
  assert set(scripts) == {"pipe-rlhf-jax", "pipe-rlhf-jax-plan", "pipe-rlhf-jax-launch",
                          "pipe-rlhf-jax-calibrate", "pipe-rlhf-jax-random-checkpoint"}
  for target in scripts.values():
    # Read, not imported: two absl entry points define the same flags in one process.
    module, _, attr = target.partition(":")
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    assert attr in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, target
