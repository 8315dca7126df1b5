"""experiments/rm_probe.py: the near-misses it scores are the kinds it names."""

import numpy as np

from experiments import rm_probe


def test_near_misses_are_one_mistake_of_their_kind():
  answers = ["dcba", "hgfe", "aab", "ba", "c"]
  misses = rm_probe.near_misses(answers, "abcdefgh", np.random.default_rng(0))
  for answer, one, copy, dropped, two, longer in zip(answers, *misses.values()):
    assert sum(a != b for a, b in zip(answer, one)) == 1 and len(one) == len(answer)
    diff = [i for i in range(len(answer)) if copy[i] != answer[i]]
    assert len(diff) == 1 and len(copy) == len(answer)
    if len(answer) > 1 and len(set(answer)) == len(answer):  # a neighbour always differs
      i = diff[0]
      assert copy[i] == answer[i - 1 if i > 0 else i + 1]
    if len(answer) > 1:
      assert dropped == answer[:-1]
    assert 1 <= sum(a != b for a, b in zip(answer, two)) <= 2
    assert longer[:-1] == answer and longer[-1] in "abcdefgh"
