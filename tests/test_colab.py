"""The notebooks execute top to bottom (at their tiny scale) and stay paired with their
percent-format scripts."""

import os

from nbclient import NotebookClient
import nbformat
import pytest

from tests.helpers.xla_env import xla_flags

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  path = os.path.join(ROOT, "colabs", "quickstart.ipynb")
  notebook = nbformat.read(path, as_version=4)
  monkeypatch.setenv("NOTEBOOK_SCALE", "tiny")
  monkeypatch.setenv("XLA_FLAGS", xla_flags(8))
  # No MPLBACKEND: the kernel's own inline backend, as in Colab, so the test sees whether
  # the notebook's figure is displayed (the library must not switch the backend).
  monkeypatch.delenv("MPLBACKEND", raising=False)
  workdir = tmp_path / "repo"
  workdir.mkdir()
  # The notebook writes runs/ under the repository it finds from its cwd.
  os.symlink(os.path.abspath(os.path.join(ROOT, "pipe_rlhf_jax")), workdir / "pipe_rlhf_jax")
  os.symlink(os.path.abspath(os.path.join(ROOT, "configs")), workdir / "configs")
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(workdir)}}).execute()
  outputs = "".join(o.get("text", "") for cell in notebook.cells
                    for o in cell.get("outputs", []))
  assert "after PPO:" in outputs and "reward/mean" in outputs
  # The reward-curve cell displayed its figure inline ...
  images = [o for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert len(images) == 1
  # ... and the run saved its own plots.
  run = workdir / "runs" / "colab-tiny"
  for name in ("reward_curve.png", "gantt.png"):
    assert (run / name).read_bytes()[:4] == b"\x89PNG", name


# Extended: CI keeps both halves of its kind, a notebook executing (the quickstart's) and
# the packaged real model RL-trained end to end (the calculator tool config's tiny run).
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.extended
def test_real_model_notebook_executes(tmp_path, monkeypatch):
  # Loads the packaged SmolLM2-135M-Instruct (installed by .ci/run) and RL-trains it for
  # two steps of short answers.
  from pipe_rlhf_jax.models import packaged
  try:
    packaged.gguf_path("smollm2-135m-instruct", install=False)
  except packaged.PackageMissing as e:
    pytest.skip(str(e))
  notebook = nbformat.read(os.path.join(ROOT, "colabs", "real_model_rl.ipynb"), as_version=4)
  monkeypatch.setenv("NOTEBOOK_SCALE", "tiny")
  monkeypatch.delenv("MPLBACKEND", raising=False)
  workdir = tmp_path / "repo"
  workdir.mkdir()
  os.symlink(os.path.abspath(os.path.join(ROOT, "pipe_rlhf_jax")), workdir / "pipe_rlhf_jax")
  os.symlink(os.path.abspath(os.path.join(ROOT, "configs")), workdir / "configs")
  NotebookClient(notebook, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(workdir)}}).execute()
  outputs = "".join(o.get("text", "") for cell in notebook.cells
                    for o in cell.get("outputs", []))
  assert "SmolLM2-135M-Instruct" in outputs and "30 layers" in outputs
  assert "math_verify:" in outputs and "after RL:" in outputs
  images = [o for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert len(images) == 1
  assert (workdir / "runs" / "colab-real-tiny" / "summary.txt").is_file()


@pytest.mark.parametrize("name", ["quickstart", "real_model_rl"])
def test_notebook_and_script_are_paired(name):
  import jupytext
  script = jupytext.read(os.path.join(ROOT, "colabs", f"{name}.py"))
  notebook = nbformat.read(os.path.join(ROOT, "colabs", f"{name}.ipynb"), as_version=4)
  assert [c.source for c in script.cells] == [c.source for c in notebook.cells]
