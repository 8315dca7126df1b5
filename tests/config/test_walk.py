"""The settings' walk through the package goes top down (tests/helpers/config_walk.py):
no function reads a settings object whose class lies in a higher layer, and no function
below the job takes the whole experiment to read one field of it."""

import subprocess

import pytest

from tests.helpers import config_walk

# The tree before the settings had a home of their own (their classes lay in the system
# layer, above the stages, models and data that read them).
BEFORE = "a11f7dd"


def test_no_function_reads_settings_from_a_higher_layer():
  assert config_walk.climbs() == []


def test_no_function_below_the_job_takes_the_experiment_for_one_field():
  assert config_walk.whole_experiment_reads() == []


def test_the_walk_climbs_less_than_half_as_often_as_before():
  try:
    subprocess.run(["git", "cat-file", "-e", BEFORE], check=True, cwd=config_walk.ROOT,
                   capture_output=True)
  except (OSError, subprocess.CalledProcessError):
    pytest.skip(f"commit {BEFORE} is not in this checkout's history")
  before = config_walk.climbs(BEFORE) + config_walk.whole_experiment_reads(BEFORE)
  now = config_walk.climbs() + config_walk.whole_experiment_reads()
  assert len(before) == 6 and len(now) <= len(before) // 2, (before, now)
